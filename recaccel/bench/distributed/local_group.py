"""The process group the multi-process benchmarks run in: gloo ranks on this machine."""

from __future__ import annotations

import datetime
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for rank 0's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Joins this process to the gloo group of ``world`` local ranks whose store is on ``port``."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
