"""The process group of a hybrid run: joining it, turning communication failures into
one-line errors, gathering evaluation results, leaving it."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from recaccel.config import ParallelConfig
from recaccel.errors import ConfigError
from recaccel.train.distributed.collectives import CollectiveError, is_comm_error
from recaccel.train.distributed.launch import under_torchrun


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


class Group:
    """This rank's place in the process group (joined here unless one exists already).

    Args:
        p: ``[parallel]`` (backend, timeout).
        device: the device kind (a CUDA device becomes ``cuda:LOCAL_RANK``).

    Raises:
        ConfigError: not launched by torchrun, or a backend that does not fit the device.
    """

    def __init__(self, p: ParallelConfig, device: torch.device) -> None:
        self.owns = not dist.is_initialized()
        if self.owns:
            if not under_torchrun():
                raise ConfigError(
                    "parallel.mode=hybrid runs one process per rank under torchrun: use "
                    "`recaccel-train --nproc N ...` or `torchrun --nproc-per-node N -m recaccel.cli ...`"
                )
            backend = p.backend if p.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        else:
            backend = dist.get_backend()
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(f"parallel.backend=nccl needs CUDA devices; train.device resolves to {device}")
        if backend == "gloo" and device.type == "cuda":
            raise ConfigError("parallel.backend=gloo runs on CPU here; use nccl (or auto) with CUDA devices")
        if device.type == "cuda":
            device = torch.device("cuda", _env_int("LOCAL_RANK", 0))
            torch.cuda.set_device(device)
        self.device = device
        self.backend = backend
        # A group made elsewhere keeps its own timeout.
        self.timeout_s = float(p.timeout_s) if self.owns else None
        if self.owns:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=p.timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE", self.world_size)
        self.comm_device = device if backend == "nccl" else torch.device("cpu")
        self.absent: Callable[[], str | None] = lambda: None  # who never arrived (the monitor's)

    def wait_for_all(self, timeout_s: float) -> None:
        """gloo: waits until every rank has joined (naming those that did not)."""
        if self.backend == "gloo":
            with self.collectives("start-up (waiting for every rank)"):
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)

    @contextmanager
    def collectives(self, what: str) -> Iterator[None]:
        """Turns a communication failure inside the block into a :class:`CollectiveError`."""
        try:
            yield
        except RuntimeError as e:
            if not is_comm_error(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            limit = (
                "the process group's timeout"
                if self.timeout_s is None
                else f"parallel.timeout_s={self.timeout_s:g}s"
            )
            absent = self.absent()
            who = "a peer rank exited or did not answer" if absent is None else absent
            raise CollectiveError(
                f"rank {self.rank} of {self.world_size}: {what} failed: {who} within {limit} ({first})"
            ) from e

    def gather(self, tensor: Tensor) -> Tensor:
        """Concatenates a per-rank [N_r, ...] tensor over ranks, in rank order (N_r may differ)."""
        with self.collectives("gathering evaluation results"):
            dev = self.comm_device
            local = tensor.detach().to(dev).contiguous()
            sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([local.shape[0]], dtype=torch.int64, device=dev))
            longest = int(max(int(s) for s in sizes))
            padded = local.new_zeros((longest, *local.shape[1:]))
            padded[: local.shape[0]] = local
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded)
        return torch.cat([part[: int(n)] for part, n in zip(parts, sizes)]).to(tensor.device)

    def close(self) -> None:
        """Leaves the process group if this object joined it."""
        if self.owns and dist.is_initialized():
            dist.destroy_process_group()
            self.owns = False
