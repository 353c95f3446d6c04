"""``parallel.straggler = "backup"`` (shared clusters, AntDT-ND; ``parallel.data = "dynamic"``).

Only a rank whose time per row exceeds ``parallel.backup_factor`` times the others'
median is cut to its speed share; the others split the rest equally (transient noise
moves nothing). It is restored once within ``sqrt(backup_factor)`` of the others.
Each rank cuts its next batches at its new size from the shards it is handed, so a
slowed rank asks for fewer shards and the faster ranks take the ones it would have
read. A rank whose queue ran dry joins the remaining steps with an empty batch, so the
epoch ends when every rank is done: no shard is left half-read.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from recaccel.train.distributed.straggler.split import MIN_SHARE, SharedSplit, floored, speed_shares


class Backup(SharedSplit):
    """Cuts a rank beyond ``backup_factor`` to its speed share; dry ranks train empty batches.

    Args:
        world_size: W.
        every: steps between decisions.
        backup_factor: the time-per-row ratio over the others' median that makes a rank
            a straggler.
        rank: this rank.
    """

    policy = "backup"
    ragged_batches = True

    def __init__(self, world_size: int, every: int, backup_factor: float, rank: int = 0) -> None:
        super().__init__(world_size, every, rank)
        self.backup_factor = backup_factor
        self._empty: Any = None  # a 0-row batch this rank trains once dry, while others finish

    def decide(self, rates: list[float]) -> list[float]:
        per_row = [1.0 / r for r in rates]
        # A straggler stays one until it is within sqrt(backup_factor) of the others
        # (hysteresis: noise around the factor must not flip its whole share back and forth).
        slow = [
            r
            for r in range(self.world_size)
            if per_row[r]
            > (math.sqrt(self.backup_factor) if r in self.stragglers else self.backup_factor)
            * statistics.median(p for q, p in enumerate(per_row) if q != r)
        ]
        self.stragglers = slow
        if not slow:
            return [1.0 / self.world_size] * self.world_size
        target = speed_shares(rates)  # straight to it: a shared cluster's straggler is sudden
        cut = {r: target[r] for r in slow}
        rest = (1.0 - sum(cut.values())) / (self.world_size - len(slow))
        return floored([cut.get(r, rest) for r in range(self.world_size)], MIN_SHARE / self.world_size)

    def seen(self, batch: Any | None) -> None:
        if self._empty is None and batch is not None:
            self._empty = batch.slice_rows(0, 0)

    def goes_on(self, ready: int, has_batch: bool) -> bool:
        """Every rank trains while any has a batch (a dry one with its empty batch)."""
        return ready == self.world_size or (ready > 0 and (has_batch or self._empty is not None))

    def local_batch(self, batch: Any | None) -> Any:
        return self._empty if batch is None else batch
