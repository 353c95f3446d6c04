"""Running a job on several gloo ranks in tests: one spawned process per rank.

``run_ranks(job, world, root, *args)`` starts ``world`` processes; each joins a gloo process
group on a free local port and calls ``job(rank, world, root, *args)`` (a module-level
function, so that spawn can import it). A rank that raises writes its traceback to
``root/error-<rank>.txt``, which fails the test with every rank's traceback. A rank may
also end itself (``fault.kill_rank``'s ``os._exit``): its peers see a dead rank.
``gloo_group_of_one()`` is a one-process group in the test's own process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(
    job: Callable[..., None], rank: int, world: int, port: int, root: str, timeout_s: float, args: tuple
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        job(rank, world, Path(root), *args)
    except BaseException:
        (Path(root) / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # skips teardown: gloo + Arrow threads can abort it (see launch.exit_rank)


def run_ranks(
    job: Callable[..., None],
    world: int,
    root: Path,
    *args: Any,
    timeout_s: float = 30.0,
    join_s: float = 180.0,
) -> None:
    """Runs ``job(rank, world, root, *args)`` on ``world`` gloo ranks and waits.

    Args:
        job: a module-level function.
        world: the number of ranks.
        root: a folder for the ranks' files (error files land here).
        *args: passed on (picklable).
        timeout_s: the process group's collective timeout.
        join_s: how long to wait for each rank before killing it.

    Raises:
        AssertionError: a rank raised (every rank's traceback in the message).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(job, r, world, port, str(root), timeout_s, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(join_s)
        if p.is_alive():
            p.kill()
    errors = [f.read_text() for f in sorted(Path(root).glob("error-*.txt"))]
    assert not errors, "\n".join(errors)


@contextlib.contextmanager
def gloo_group_of_one():
    """A real one-process gloo group on a free local port, destroyed on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
