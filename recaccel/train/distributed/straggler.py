"""Straggler mitigation of hybrid runs (``parallel.straggler``), as AntDT's controller.

In synchronous training every step waits for the slowest rank. Each rank measures its
step's compute (step time less the time inside collectives, :class:`~recaccel.train.
distributed.monitor.Monitor`) and the rows (or tasks) it trained; the next step's
agreement allreduce carries every rank's pair in its own slots (a sum with one non-zero
term per slot: exact, so every rank holds the same numbers). A :class:`SplitController`
on each rank turns them, every ``parallel.straggler_every`` steps, into each rank's share
of the global batch, the same decision everywhere:

- ``rebalance`` (dedicated clusters, AntDT-DD; ``parallel.data = "global"``): shares move
  halfway towards each rank's measured speed (rows per second of compute). With a
  fixed per-step cost the fixed point is equal compute times, the best a synchronous
  step can do. Every rank reads the global batch and trains its share's slice of it.
- ``backup`` (shared clusters, AntDT-ND; ``parallel.data = "dynamic"``): only a rank whose
  time per row exceeds ``parallel.backup_factor`` times the others' median is cut to
  its speed share; the others split the rest equally (transient noise moves nothing). It
  is restored once within ``sqrt(backup_factor)`` of the others.
  Each rank cuts its next batches at its new size from the shards it is handed, so a
  slowed rank asks for fewer shards and the faster ranks take the ones it would have
  read. A rank whose queue ran dry joins the remaining steps with an empty batch, so
  the epoch ends when every rank is done: no shard is left half-read.

The update does not depend on the split: rank r's loss is its mean times ``n_r / N``
(its share of the global normaliser, agreed every step), so the summed gradient is that
of the global mean, whatever the ``n_r`` (:func:`weighted_gradient_check` in the tests).
Both need unequal local batches through TorchRec, which table-wise and column-wise
sharding carry and row-wise (equal all-gather blocks) does not.

::

    compute_s  [0.10, 0.10, 0.20, 0.10]   rows [64, 64, 64, 64]
    rebalance  rate = rows / compute -> shares 0.25 -> (0.25 + 0.286) / 2 ...
    backup     rank 2: 2.0x the median time per row > 1.5 -> share 0.143, others 0.286
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from recaccel.config import Config
from recaccel.errors import ConfigError

MIN_SHARE = 0.25  # a rank keeps at least this fraction of an equal share (its speed stays measured)
_DATA = {"rebalance": "global", "backup": "dynamic"}


def check_straggler(cfg: Config) -> None:
    """Refuses straggler settings this hybrid run cannot act on (before any work).

    Raises:
        ConfigError: a policy with the wrong ``parallel.data``, a pipeline or no drop_last.
    """
    policy = cfg.parallel.straggler
    if policy == "off":
        return
    if cfg.parallel.data != _DATA[policy]:
        raise ConfigError(
            f"parallel.straggler={policy} needs parallel.data={_DATA[policy]}, got {cfg.parallel.data}"
        )
    if cfg.train.pipeline != "off":
        raise ConfigError(
            f"parallel.straggler={policy} splits batches step by step: set train.pipeline=off "
            f"(got {cfg.train.pipeline})"
        )


def check_plan_kinds(policy: str, kinds: dict[str, str]) -> None:
    """Refuses row-wise tables under a straggler policy (their backward needs equal batches).

    Args:
        policy: ``parallel.straggler``.
        kinds: each sharded table's kind in TorchRec's plan.

    Raises:
        ConfigError: a row-wise table (naming it).
    """
    if policy == "off":
        return
    bad = sorted(t for t, kind in kinds.items() if kind not in ("table_wise", "column_wise"))
    if bad:
        raise ConfigError(
            f"parallel.straggler={policy} gives ranks unequal batches, which table {bad[0]!r} "
            f"({kinds[bad[0]]}) cannot take; set parallel.sharding=table_wise or column_wise"
        )


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


class SplitController:
    """Each rank's share of the global batch from measured speed (the same on every rank).

    Args:
        policy: ``rebalance`` or ``backup`` (``off``: shares stay equal).
        world_size: W.
        every: steps between decisions.
        backup_factor: ``backup``: the time-per-row ratio over the others' median that
            makes a rank a straggler.
    """

    def __init__(self, policy: str, world_size: int, every: int, backup_factor: float) -> None:
        self.policy = policy
        self.world_size = world_size
        self.every = every
        self.backup_factor = backup_factor
        self.shares = [1.0 / world_size] * world_size
        self.stragglers: list[int] = []  # backup: ranks cut to their speed share
        self.decisions = 0
        self._changed = False  # shares changed since take_event
        self._time = [0.0] * world_size  # this window's compute seconds per rank
        self._units = [0] * world_size  # ... and rows (or tasks) per rank
        self._steps = 0

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
        self.shares = self._rebalanced(rates) if self.policy == "rebalance" else self._backed_up(rates)
        self.decisions += 1
        self._changed |= self.shares != before
        return self.shares != before

    def split(self, total: int) -> list[int]:
        """Units of a global batch of ``total`` per rank."""
        return split_units(total, self.shares)

    def local_sizes(self, batch_size: int) -> list[int]:
        """``backup``: each rank's local batch when the global one is ``W * batch_size``."""
        return split_units(self.world_size * batch_size, self.shares)

    def take_event(self) -> dict[str, Any] | None:
        """The new split's ``straggler`` event fields once after it changed, else None."""
        if not self._changed:
            return None
        self._changed = False
        return {"shares": [round(s, 4) for s in self.shares], "stragglers": list(self.stragglers)}

    def summary(self) -> dict[str, Any]:
        """For metrics.json: the policy, the decisions taken and the final shares."""
        return {
            "policy": self.policy,
            "every": self.every,
            "decisions": self.decisions,
            "shares": [round(s, 4) for s in self.shares],
            "stragglers": list(self.stragglers),
        }

    def _rebalanced(self, rates: list[float]) -> list[float]:
        target = _speed_shares(rates)
        mixed = [(s + t) / 2 for s, t in zip(self.shares, target)]  # halfway: no oscillation
        return _floored(mixed, MIN_SHARE / self.world_size)

    def _backed_up(self, rates: list[float]) -> list[float]:
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
        target = _speed_shares(rates)  # straight to it: a shared cluster's straggler is sudden
        cut = {r: target[r] for r in slow}
        rest = (1.0 - sum(cut.values())) / (self.world_size - len(slow))
        return _floored([cut.get(r, rest) for r in range(self.world_size)], MIN_SHARE / self.world_size)


def _speed_shares(rates: list[float]) -> list[float]:
    """Shares proportional to each rank's units per compute second in the current split
    (whose fixed point is equal compute times)."""
    total = sum(rates)
    return [r / total for r in rates]


def _floored(shares: list[float], floor: float) -> list[float]:
    """``shares`` with each at least ``floor``, renormalised to sum to 1."""
    raised = [max(s, floor) for s in shares]
    total = sum(raised)
    return [s / total for s in raised]


__all__ = ["SplitController", "check_plan_kinds", "check_straggler", "split_units"]
