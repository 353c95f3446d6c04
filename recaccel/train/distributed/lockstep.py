"""The per-step agreement of hybrid ranks: one small allreduce before every step.

Its slots (float64, summed over ranks; each slot has at most one non-zero term where a
rank writes its own, so the sums are exact and every rank reads the same numbers):

====================  =======================================================
``0``                 ranks that have a batch for the step
``1``, ``2``          the step's global loss normaliser and training rows
``3 .. 3+W``          each rank's compute seconds of its last step
``3+W .. 3+2W``       each rank's units (rows or tasks) of its last step
``3+2W ..``           one slot per stop signal: the ranks that got it
====================  =======================================================

A stop signal any rank got becomes the agreed stop of every rank at once, so all stop
after the same step (SIGTERM before SIGINT when ranks got both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from recaccel.train.loop.preemption import STOP_SIGNALS

_SIGNALS = [s.name for s in STOP_SIGNALS]


@dataclass
class Agreed:
    """What every rank read from one agreement.

    Attributes:
        ready: ranks that have a batch.
        denominator: the step's global loss normaliser.
        rows: the step's training rows over all ranks.
        compute_s: each rank's compute seconds of its last step (0: none reported).
        units: each rank's rows (or tasks) of its last step.
    """

    ready: int
    denominator: float
    rows: int
    compute_s: list[float]
    units: list[float]


class Lockstep:
    """Fills this rank's slots of the agreement and reads the summed result.

    Args:
        rank: this rank.
        world_size: W.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stop: str | None = None  # a stop signal some rank got, agreed by all (sticky)
        self._last: tuple[float, int] | None = None  # (compute s, units) of this rank's last step

    @property
    def nbytes(self) -> int:
        """The size of one agreement's buffer."""
        return (3 + 2 * self.world_size + len(_SIGNALS)) * 8

    def exchange(
        self, has_batch: bool, normaliser: tuple[float, int] | None, signal: str | None, device: torch.device
    ) -> Agreed:
        """One agreement: this rank's :meth:`slots` summed over ranks on ``device``, :meth:`read`."""
        buffer = self.slots(has_batch, normaliser, signal).to(device)
        dist.all_reduce(buffer)
        return self.read(buffer.cpu())

    def trained(self, compute_s: float, units: int) -> None:
        """Reports this rank's last step for the next agreement (units 0: nothing to report)."""
        self._last = (compute_s, units) if units else None

    def slots(self, has_batch: bool, normaliser: tuple[float, int] | None, signal: str | None) -> Tensor:
        """This rank's contribution: whether it has a batch, its (normaliser, rows) when it
        counts them, its last step's timing (once) and the stop signal it got."""
        w = self.world_size
        info = torch.zeros(3 + 2 * w + len(_SIGNALS), dtype=torch.float64)
        if signal is not None:
            info[3 + 2 * w + _SIGNALS.index(signal)] = 1.0
        if has_batch:
            info[0] = 1.0
        if normaliser is not None:
            info[1], info[2] = normaliser
        if self._last is not None:
            info[3 + self.rank], info[3 + w + self.rank] = self._last
            self._last = None
        return info

    def read(self, info: Tensor) -> Agreed:
        """The summed slots; records the first stop signal any rank got."""
        w = self.world_size
        stops = 3 + 2 * w
        got = [name for name, n in zip(_SIGNALS, info[stops:].tolist()) if n > 0]
        if got and self.stop is None:
            self.stop = got[0]
        return Agreed(
            int(info[0]), float(info[1]), int(info[2]), info[3 : 3 + w].tolist(), info[3 + w : stops].tolist()
        )
