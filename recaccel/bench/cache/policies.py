"""Trace-driven simulation of one embedding table's row cache: lookahead vs LRU, LFU, Belady.

A trace is one table's lookups batch by batch: ``Trace.batches[i]`` holds the unique rows
(table-local ids) batch ``i`` looks up. The cache holds at most ``capacity`` rows. Every
policy has all of batch i's rows resident at batch i's lookup (the lookup and update run
on the cache); the policies differ in when rows are fetched and which resident rows make
room for them:

- ``lru``, ``lfu``, ``belady`` fetch on demand: before batch i's lookup, its rows that are
  not resident are fetched; victims are resident rows batch i does not look up.
  ``lru``: the least recently looked-up row first. ``lfu``: the row the fewest batches
  have looked up since the trace began (counts outlive eviction, as in FBGEMM's LFU
  cache), ties to the least recently used. ``belady``, the offline optimum: the row
  whose next lookup is farthest in the future (never again is farthest).
- ``lookahead`` with window k (recaccel's policy): before batch i's lookup, every row of
  batches i..i+k-1 (fewer at the trace's end) is made resident; victims only among
  resident rows none of those k batches needs, the least recently looked-up first
  (``beyond="lfu"``: the least frequently, as ``lfu``). A row fetched ahead for batch
  j > i is in every window up to j's, so it stays until j's lookup. k = 1 is fetch on
  demand with LRU beyond the batch: the same as ``lru``. With LRU beyond the window,
  every feasible k transfers exactly the rows ``lru`` does, only earlier: both keep a
  row from one use to the next iff fewer than ``capacity`` rows were looked up more
  recently by then (a reuse within k batches always qualifies: the rows in between lie
  in one window, which fits).

Remaining ties go to the smaller row id, so every run is deterministic.

Hits and misses: a row of batch i is a *hit* when it has stayed resident since the last
earlier batch that looked it up; a *miss* otherwise (its first use, or evicted since):
it had to be transferred for batch i, by batch i's own fetch or by an earlier window's
prefetch. So misses are rows transferred, and ``hit rate = 1 - transferred / requested``
with ``requested`` = the sum over batches of their unique rows. Rows prefetched ahead do
not count as hits: with k >= 2 every row of batch i is resident when batch i's prefetch
starts (the previous window fetched it), which would make the hit rate
``1 - |batch 0| / requested`` whatever the cache size, a measure of latency hiding, not
of the cache. Belady's transfers are a lower bound for every policy, prefetching ones
included (any prefetch can be put off until the row's use without an extra transfer),
so its hit rate is the highest of all.

A cache smaller than one batch's unique rows (for ``lookahead``, one window's) cannot
serve that batch: the cell is infeasible, with the reason instead of a hit rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from recaccel.errors import ConfigError

POLICIES = ("lookahead", "lru", "lfu", "belady")
_LOCKED = np.iinfo(np.int64).max

Observer = Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]
"""``observe(i, fetched, evicted, resident)`` after batch i's fetch: the rows fetched and
evicted for it and the rows resident at its lookup (int64 arrays)."""


@dataclass(frozen=True, eq=False)
class Trace:
    """One table's lookups, batch by batch.

    Attributes:
        name: What the trace is, e.g. ``zipf-1.05``.
        rows: The table's rows R (every id lies in ``[0, R)``).
        batches: Per batch, its unique row ids, sorted, int64.
        description: One line on how the trace was made.
    """

    name: str
    rows: int
    batches: tuple[np.ndarray, ...]
    description: str = ""

    @classmethod
    def from_ids(cls, name: str, rows: int, batches: Sequence[Sequence[int]], description: str = "") -> Trace:
        """A trace from each batch's ids (duplicates allowed: a bag may repeat a row).

        Raises:
            ConfigError: no ids at all, or an id outside ``[0, rows)``.
        """
        unique = tuple(np.unique(np.asarray(b, dtype=np.int64)) for b in batches)
        if not any(len(u) for u in unique):
            raise ConfigError(f"cache trace {name!r}: no ids")
        for i, u in enumerate(unique):
            if len(u) and (u[0] < 0 or u[-1] >= rows):
                raise ConfigError(f"cache trace {name!r}: batch {i} has ids outside [0, {rows})")
        return cls(name, rows, unique, description)

    @property
    def requested(self) -> int:
        """Unique rows looked up, summed over batches (the hit rate's denominator)."""
        return sum(len(b) for b in self.batches)

    @property
    def distinct(self) -> int:
        """Rows looked up at least once: each is a miss at its first use whatever the cache."""
        return len(np.unique(np.concatenate(self.batches)))

    def window(self, i: int, k: int) -> np.ndarray:
        """The unique rows of batches ``i .. i+k-1`` (fewer at the end), sorted."""
        if k == 1:
            return self.batches[i]
        return np.unique(np.concatenate(self.batches[i : i + k]))


@dataclass(frozen=True)
class Outcome:
    """One policy replayed on one trace at one capacity.

    Attributes:
        requested: Unique rows looked up, summed over batches.
        transferred: Rows fetched into the cache (= misses); None when infeasible.
        reason: Why the cell is infeasible; None when it ran.
    """

    requested: int
    transferred: int | None
    reason: str | None = None

    @property
    def hit_rate(self) -> float | None:
        """``1 - transferred / requested``; None when infeasible."""
        if self.transferred is None:
            return None
        return 1.0 - self.transferred / self.requested


class _Slots:
    """The cache's contents: ``capacity`` slots, each empty or holding one row."""

    def __init__(self, rows: int, capacity: int):
        self.capacity = capacity
        self.row_at = np.full(capacity, -1, dtype=np.int64)  # slot -> row
        self.slot_of = np.full(rows, -1, dtype=np.int64)  # row -> slot, -1 = not resident
        self.used = 0  # slots 0..used-1 are filled (evicted slots are refilled at once)

    def missing(self, rows: np.ndarray) -> np.ndarray:
        return rows[self.slot_of[rows] < 0]

    def resident(self) -> np.ndarray:
        return self.row_at[: self.used].copy()

    def admit(
        self, new: np.ndarray, locked: np.ndarray, keys: Callable[[np.ndarray], np.ndarray]
    ) -> np.ndarray:
        """Makes ``new`` resident, evicting the unlocked rows with the smallest keys.

        Args:
            new: Rows to fetch, not resident.
            locked: Rows that must stay (a superset of ``new``'s batch or window).
            keys: Resident rows -> distinct int64 eviction keys, smallest evicted first.

        Returns:
            The evicted rows.
        """
        need = self.used + len(new) - self.capacity
        free = np.arange(self.used, min(self.capacity, self.used + len(new)))
        evicted = np.empty(0, dtype=np.int64)
        if need > 0:
            held = self.row_at[: self.used]
            key = keys(held)
            slots = self.slot_of[locked]
            key[slots[slots >= 0]] = _LOCKED
            victims = np.argpartition(key, need - 1)[:need]
            assert key[victims].max() < _LOCKED, "a locked row was chosen as victim"
            evicted = held[victims].copy()
            self.slot_of[evicted] = -1
            free = np.concatenate([free, victims])
            self.used = self.capacity
        else:
            self.used += len(new)
        self.row_at[free] = new
        self.slot_of[new] = free
        return evicted


def _next_uses(trace: Trace) -> list[np.ndarray]:
    """Per batch i, aligned with its rows: the next batch after i looking each up (T = never)."""
    last = np.full(trace.rows, len(trace.batches), dtype=np.int64)
    out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(trace.batches)
    for i in range(len(trace.batches) - 1, -1, -1):
        rows = trace.batches[i]
        out[i] = last[rows]
        last[rows] = i
    return out


def largest_need(trace: Trace, lookahead: int) -> tuple[int, int]:
    """(batch, rows): the batch whose window of ``lookahead`` batches holds the most unique rows."""
    sizes = [len(trace.window(i, lookahead)) for i in range(len(trace.batches))]
    i = int(np.argmax(sizes))
    return i, sizes[i]


def simulate(
    trace: Trace,
    capacity: int,
    policy: str,
    lookahead: int = 1,
    beyond: str = "lru",
    observe: Observer | None = None,
) -> Outcome:
    """Replays ``trace`` through a cache of ``capacity`` rows under ``policy``.

    Args:
        trace: The lookups.
        capacity: Rows the cache holds (>= 1).
        policy: One of :data:`POLICIES`.
        lookahead: k, the batches whose rows are resident before a lookup (``lookahead`` only).
        beyond: ``lru`` or ``lfu``, the victims' order among rows outside the window (``lookahead`` only).
        observe: Called after each batch's fetch (see :data:`Observer`), for tests.

    Returns:
        Transfers and hit rate, or the reason the cell is infeasible.

    Raises:
        ConfigError: an unknown policy, a capacity or lookahead < 1.
    """
    if policy not in POLICIES:
        raise ConfigError(f"cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if capacity < 1 or lookahead < 1:
        raise ConfigError(f"cache capacity and lookahead must be >= 1, got {capacity} and {lookahead}")
    if beyond not in ("lru", "lfu"):
        raise ConfigError(f"cache lookahead's victims beyond the window: lru or lfu, got {beyond!r}")
    k = lookahead if policy == "lookahead" else 1
    batch, need = largest_need(trace, k)
    if need > capacity:
        what = f"batches {batch}..{batch + k - 1}" if k > 1 else f"batch {batch}"
        return Outcome(trace.requested, None, f"{what} need {need} rows > {capacity} cached")
    order = beyond if policy == "lookahead" else policy
    return Outcome(trace.requested, _replay(trace, capacity, order, k, observe))


def _replay(trace: Trace, capacity: int, order: str, k: int, observe: Observer | None) -> int:
    """Rows transferred replaying a feasible cell, victims by ``order`` (lru, lfu or belady)."""
    n, t = trace.rows, len(trace.batches)
    if order == "lfu" and (t + 1) ** 2 * n >= 2**63:
        raise ConfigError(f"cache trace {trace.name!r}: too many batches x rows for LFU's int64 keys")
    slots = _Slots(n, capacity)
    last_use = np.full(n, -1, dtype=np.int64)  # batch of the latest lookup, -1 = none
    uses = np.zeros(n, dtype=np.int64)  # batches that looked the row up so far
    next_use = np.full(n, t, dtype=np.int64)  # after the latest lookup (belady)
    nexts = _next_uses(trace) if order == "belady" else None
    keys = {
        "lru": lambda held: (last_use[held] + 1) * n + held,
        "lfu": lambda held: (uses[held] * (t + 1) + last_use[held] + 1) * n + held,
        "belady": lambda held: (t - next_use[held]) * n + held,
    }[order]
    transferred = 0
    for i, rows in enumerate(trace.batches):
        needed = trace.window(i, k)
        new = slots.missing(needed)
        evicted = slots.admit(new, needed, keys)
        transferred += len(new)
        if observe is not None:
            observe(i, new, evicted, slots.resident())
        last_use[rows] = i
        uses[rows] += 1
        if nexts is not None:
            next_use[rows] = nexts[i]
    return transferred
