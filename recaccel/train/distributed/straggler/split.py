"""What every straggler policy shares: splitting a global batch by shares
(:func:`split_units`), and :class:`SharedSplit`, the per-rank shares of the global batch
that a policy moves every ``parallel.straggler_every`` steps from measured speed (the
same decision on every rank, from the same agreed numbers).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from recaccel.errors import ConfigError
from recaccel.train.distributed.straggler.policy import StragglerPolicy
from recaccel.train.loop.observers import Note, StepDone

MIN_SHARE = 0.25  # a rank keeps at least this fraction of an equal share (its speed stays measured)


def split_units(total: int, shares: Sequence[float], minimum: int = 1) -> list[int]:
    """``total`` units split by ``shares`` (largest remainder, ties to the lower rank), each
    rank at least ``minimum``.

    Raises:
        ConfigError: fewer units than ranks times ``minimum``.
    """
    ranks = len(shares)
    if total < ranks * minimum:
        raise ConfigError(f"a global batch of {total} cannot give each of {ranks} ranks {minimum}")
    spare = total - ranks * minimum
    weight = sum(shares)
    exact = [spare * s / weight for s in shares]
    parts = [math.floor(x) for x in exact]
    order = sorted(range(ranks), key=lambda r: (-(exact[r] - parts[r]), r))
    for r in order[: spare - sum(parts)]:
        parts[r] += 1
    return [minimum + p for p in parts]


class SharedSplit(StragglerPolicy, ABC):
    """Each rank's share of the global batch from measured speed (the same on every rank).

    A policy says how a window's rates become new shares (:meth:`decide`); this class
    sums each window of ``every`` steps, reports a new split once as a ``straggler``
    note and the policy's decisions in the final metrics.

    Args:
        world_size: W.
        every: steps between decisions.
        rank: this rank.
    """

    def __init__(self, world_size: int, every: int, rank: int = 0) -> None:
        super().__init__(rank, world_size)
        self.every = every
        self.shares = [1.0 / world_size] * world_size
        self.stragglers: list[int] = []  # ranks found slow by the last decision
        self.decisions = 0
        self._changed = False  # shares changed since take_event
        self._time = [0.0] * world_size  # this window's compute seconds per rank
        self._units = [0] * world_size  # ... and rows (or tasks) per rank
        self._steps = 0

    @abstractmethod
    def decide(self, rates: list[float]) -> list[float]:
        """The next shares from each rank's units per compute second over a window."""

    def observe(self, compute_s: Sequence[float], units: Sequence[float]) -> bool:
        """Adds one step's per-rank compute time and units; decides when a window is full.

        Returns:
            Whether the shares changed.
        """
        if not any(units):
            return False  # no step before this agreement (the first of a run or epoch)
        for r in range(self.world_size):
            self._time[r] += float(compute_s[r])
            self._units[r] += int(units[r])
        self._steps += 1
        if self._steps < self.every:
            return False
        rates = [u / t if t > 0 and u > 0 else 0.0 for u, t in zip(self._units, self._time)]
        self._time, self._units, self._steps = [0.0] * self.world_size, [0] * self.world_size, 0
        if not all(rates):
            return False  # a rank trained nothing in the window: nothing to compare
        before = list(self.shares)
        self.shares = self.decide(rates)
        self.decisions += 1
        self._changed |= self.shares != before
        return self.shares != before

    def split(self, total: int) -> list[int]:
        """Units of a global batch of ``total`` per rank."""
        return split_units(total, self.shares)

    def local_sizes(self, batch_size: int) -> list[int]:
        """Each rank's local batch when the global one is ``W * batch_size``."""
        return split_units(self.world_size * batch_size, self.shares)

    def local_rows(self, batch_size: int) -> int:
        return self.local_sizes(batch_size)[self.rank]

    def take_event(self) -> dict[str, Any] | None:
        """The new split's ``straggler`` event fields once after it changed, else None."""
        if not self._changed:
            return None
        self._changed = False
        return {"shares": [round(s, 4) for s in self.shares], "stragglers": list(self.stragglers)}

    def after_step(self, step: int, done: StepDone) -> list[Note]:
        """A ``straggler`` note (and console line) once after the split changed."""
        change = self.take_event()
        if change is None:
            return []
        return [
            Note("straggler", {"step": step, **change}, "straggler at step %d: %s", (step, _text(change)))
        ]

    def summary(self) -> dict[str, Any]:
        """For metrics.json: the policy, the decisions taken and the final shares."""
        return {
            "policy": self.policy,
            "every": self.every,
            "decisions": self.decisions,
            "shares": [round(s, 4) for s in self.shares],
            "stragglers": list(self.stragglers),
        }

    def final_metrics(self) -> dict[str, Any]:
        return {"straggler": self.summary()} if self.rank == 0 else {}


def _text(change: dict[str, Any]) -> str:
    """A straggler decision in words: each rank's share of the batch and the ranks found slow."""
    shares = ", ".join(f"rank {r} {share:.0%}" for r, share in enumerate(change.get("shares", [])))
    slow = change.get("stragglers") or []
    found = f"slow: {', '.join(f'rank {r}' for r in slow)}" if slow else "no rank slow"
    return f"{found}; shares {shares}"


def speed_shares(rates: list[float]) -> list[float]:
    """Shares proportional to each rank's units per compute second in the current split
    (whose fixed point is equal compute times)."""
    total = sum(rates)
    return [r / total for r in rates]


def floored(shares: list[float], floor: float) -> list[float]:
    """``shares`` with each at least ``floor``, renormalised to sum to 1."""
    raised = [max(s, floor) for s in shares]
    total = sum(raised)
    return [s / total for s in raised]
