"""``parallel.straggler = "rebalance"`` (dedicated clusters, AntDT-DD; ``parallel.data = "global"``).

Shares move halfway towards each rank's measured speed (rows per second of compute).
With a fixed per-step cost the fixed point is equal compute times, the best a
synchronous step can do. Every rank reads the global batch and trains its share's slice
of it; rank 0 alone puts the global batch's normaliser and rows into the agreement.
"""

from __future__ import annotations

from typing import Any

from recaccel.train.distributed.hybrid_data import slice_units, units
from recaccel.train.distributed.straggler.split import MIN_SHARE, SharedSplit, floored, speed_shares


class Rebalance(SharedSplit):
    """Shares halfway to measured speed; each rank trains its slice of the global batch.

    Args:
        world_size: W.
        every: steps between decisions.
        rank: this rank.
    """

    policy = "rebalance"
    global_batches = True

    def decide(self, rates: list[float]) -> list[float]:
        target = speed_shares(rates)
        mixed = [(s + t) / 2 for s, t in zip(self.shares, target)]  # halfway: no oscillation
        return floored(mixed, MIN_SHARE / self.world_size)

    def counts_normaliser(self) -> bool:
        return self.rank == 0  # every rank holds the same global batch

    def local_batch(self, batch: Any | None) -> Any:
        """This rank's slice of the global ``batch`` by the current shares."""
        sizes = self.split(units(batch))
        lo = sum(sizes[: self.rank])
        return slice_units(batch, lo, lo + sizes[self.rank])
