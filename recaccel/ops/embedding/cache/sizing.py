"""Sizing the device cache of host tables at start, from the rows the first batches need.

A preparation fails (:meth:`~recaccel.ops.embedding.cache.pack.CachedPack.prepare`, "needs
N unique rows") when its batch's unique rows and the rows the window keeps locked do not
fit in the cache. The window locks ``model.cache_lookahead + 1`` training batches, and it
still holds them while an evaluation batch (``data.eval_batch_size`` rows, often many more
than a training batch) is looked up. The trainer measures what its first batches need
(:func:`pack_rows`, :func:`window_needs`) and :func:`plan_cache` decides, before the
first step:

- enough room: nothing changes;
- a cache sized by ``model.cache_fraction`` (a share, a guess): it grows to the rows
  needed plus a quarter for batches not measured, at most the pack's rows;
- a cache sized by ``model.cache_rows`` (a hard cap): the lookahead is shortened to the
  longest whose window fits; when even ``model.cache_lookahead = 1`` does not fit, the run
  is refused in one line naming the rows needed and the key to raise.

Either change is one logged warning. A cache's size never changes results (every id
reads and updates its own row), only the traffic; the lookahead is the pipeline's.

Shapes: U unique rows of a batch in a pack.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.ops.embedding.packing import PackingPlan
from recaccel.sparse import SparseFeatures

HEADROOM = 0.25  # grown caches: room for batches past the measured ones


def pack_rows(plan: PackingPlan, sf: SparseFeatures, packs: set[int]) -> dict[int, Tensor]:
    """Unique packed rows [U] of one batch in each of ``packs`` (pack indices of ``plan``);
    features no table of those packs looks up are left out."""
    parts: dict[int, list[Tensor]] = {p: [] for p in packs}
    for name in sf.keys:
        slot = plan.slots.get(name)
        if slot is not None and slot.pack in parts:
            parts[slot.pack].append(sf.field(name)[0] + slot.row_offset)
    return {
        p: torch.unique(torch.cat(v)) if v else torch.empty(0, dtype=torch.int64) for p, v in parts.items()
    }


def window_needs(train: list[Tensor], evals: list[Tensor], window: int) -> tuple[int, int]:
    """Slots needed at once with a window of ``window`` training batches.

    Args:
        train: unique rows of consecutive training batches, in order.
        evals: unique rows of evaluation batches.
        window: training batches locked at once.

    Returns:
        (training, evaluation): the most rows of ``window`` consecutive training batches
        together, and of such a window together with one evaluation batch.
    """
    starts = range(max(len(train) - window + 1, 1))
    windows = [_union(train[i : i + window]) for i in starts]
    need_train = max((w.numel() for w in windows), default=0)
    need_eval = max((_union([w, e]).numel() for w in windows for e in evals), default=0)
    return need_train, need_eval


def _union(rows: list[Tensor]) -> Tensor:
    return torch.unique(torch.cat(rows)) if rows else torch.empty(0, dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class PackNeed:
    """What one host pack's cache holds and what the first batches need of it.

    Attributes:
        tables: its tables' names, for messages.
        num_rows: R, its rows (the most a cache can hold).
        capacity: C, its cache's slots now.
        needs: per window (training batches locked), the (training, evaluation) rows
            needed at once (:func:`window_needs`).
    """

    tables: tuple[str, ...]
    num_rows: int
    capacity: int
    needs: dict[int, tuple[int, int]]

    def need(self, window: int) -> int:
        return max(self.needs[window])


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """The caches' sizes and window to run with.

    Attributes:
        capacities: per pack, its cache's slots.
        window: training batches locked at once (``model.cache_lookahead + 1``).
        warning: one line saying what changed and why; None when nothing did.
    """

    capacities: tuple[int, ...]
    window: int
    warning: str | None = None


def plan_cache(needs: list[PackNeed], window: int, cache_rows: int, cache_fraction: float) -> CachePlan:
    """The sizes and window that hold what the first batches need (the module docstring's rule).

    Args:
        needs: the host packs.
        window: the configured window (``model.cache_lookahead + 1``).
        cache_rows: ``model.cache_rows`` (> 0: a hard cap).
        cache_fraction: ``model.cache_fraction``, for messages.

    Raises:
        ConfigError: a hard cap below what one training window of the shortest lookahead
            (and an evaluation batch with it) needs.
    """
    now = tuple(n.capacity for n in needs)
    if all(n.need(window) <= n.capacity for n in needs):
        return CachePlan(now, window)
    if cache_rows <= 0:
        return _grown(needs, window, cache_fraction)
    for shorter in range(window - 1, 1, -1):
        if all(n.need(shorter) <= n.capacity for n in needs):
            worst = max(needs, key=lambda n: n.need(window))
            return CachePlan(
                now,
                shorter,
                f"model.cache_lookahead={window - 1} locks batches needing {worst.need(window)} rows in the "
                f"device cache of host tables {list(worst.tables)}, which model.cache_rows={cache_rows} caps: "
                f"lookahead shortened to {shorter - 1} at start (raise model.cache_rows to keep it)",
            )
    raise _refusal(max(needs, key=lambda n: n.need(2) - n.capacity), cache_rows)


def _grown(needs: list[PackNeed], window: int, cache_fraction: float) -> CachePlan:
    """Every short cache grown to its need plus :data:`HEADROOM` (at most its pack's rows)."""
    sizes, said = [], []
    for n in needs:
        need = n.need(window)
        if need <= n.capacity:
            sizes.append(n.capacity)
            continue
        size = min(n.num_rows, need + int(need * HEADROOM))
        sizes.append(size)
        said.append(f"host tables {list(n.tables)}: {n.capacity} -> {size} rows ({_what(n, window)})")
    return CachePlan(
        tuple(sizes),
        window,
        f"model.cache_fraction={cache_fraction} leaves the device cache too small for the first batches; "
        f"sized at start: {'; '.join(said)}",
    )


def _what(n: PackNeed, window: int) -> str:
    train, evals = n.needs[window]
    locked = f"{window} training batches locked"
    if evals > train:
        return f"an evaluation batch with the {locked} needs {evals}"
    return f"the {locked} need {train}"


def _refusal(n: PackNeed, cache_rows: int) -> ConfigError:
    train, evals = n.needs[2]
    locked = "the 2 training batches the window locks"
    what = f"an evaluation batch with {locked}" if evals > train else locked
    need = max(train, evals)
    return ConfigError(
        f"PackedEmbeddingBag: the device cache of host tables {list(n.tables)} has {n.capacity} rows "
        f"(model.cache_rows={cache_rows}), but {what} needs {need} unique rows even at "
        f"model.cache_lookahead=1; raise model.cache_rows to at least {need} "
        "(or lower data.batch_size / data.eval_batch_size)"
    )
