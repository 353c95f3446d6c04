"""The interface of a straggler policy (``parallel.straggler``), and ``off``.

What a policy decides, step by step, on every rank alike:

- how the batch is split among ranks: whether ranks read the global batch and each
  trains its slice (:attr:`StragglerPolicy.global_batches`, :meth:`local_batch`), and
  whether a rank's batch size follows the split (:attr:`ragged_batches`, :meth:`local_rows`);
- what this rank puts into the per-step agreement (:meth:`counts_normaliser`) and what
  it makes of the agreed timings (:meth:`observe`);
- whether a step goes on when some rank has run dry (:meth:`goes_on`): a backup rank's
  empty step then stands in for it while the others finish their shards.

A policy is also a step observer: it reports a new split and its decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recaccel.train.loop.observers import StepObserver


class StragglerPolicy(StepObserver):
    """``off``: equal batches, every rank trains its own, an epoch ends when one rank runs dry.

    Args:
        rank: this rank.
        world_size: W.
    """

    name = "straggler"
    policy = "off"
    global_batches = False  # every rank reads the global batch and trains its slice of it
    ragged_batches = False  # a rank's batch size follows the split (dynamic shards)

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def seen(self, batch: Any | None) -> None:
        """This rank's next batch (None: it ran dry), before the step's agreement."""

    def counts_normaliser(self) -> bool:
        """Whether this rank's batch normaliser and rows enter the agreement's sums."""
        return True

    def observe(self, compute_s: Sequence[float], units: Sequence[float]) -> bool:
        """One step's agreed per-rank compute seconds and units; returns whether the split changed."""
        return False

    def goes_on(self, ready: int, has_batch: bool) -> bool:
        """Whether the step goes on when ``ready`` ranks have a batch (this one: ``has_batch``)."""
        return ready == self.world_size

    def local_batch(self, batch: Any | None) -> Any:
        """What this rank trains of the agreed step's ``batch``."""
        return batch

    def local_rows(self, batch_size: int) -> int:
        """This rank's batch size under the current split (``data.batch_size`` each when equal)."""
        return batch_size

    def summary(self) -> dict[str, Any]:
        """For metrics.json (``off``: nothing)."""
        return {}


class Off(StragglerPolicy):
    """``parallel.straggler = "off"``: the interface's defaults."""
