"""Grouping a pack's id occurrences by packed row: the dedup step of every backward.

A stable sort of each pack's packed rows (one sort for all packs of a batch on CUDA,
:class:`PackSort`) gives the occurrences' order, the unique rows and their segments.

Shapes: N_p ids of a pack, U unique rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

INT32_ROWS = 2**31  # packed rows below this fit int32 sort keys
AfterSort = Callable[["RowGroups"], None]  # work on a grouping once it is sorted


class RowGroups:
    """A pack's id occurrences grouped by packed row (:func:`group_by_row`).

    Unpacks as ``order, unique_rows, segments``. ``unique_rows`` and ``segments`` have a
    data-dependent size U (a host synchronization to make): :func:`group_by_row` makes
    them at once when asked, else on first access, from the sorted keys it keeps. A
    grouping queued on a :class:`PackSort` is sorted with the other packs' when the sort
    runs (or when its order is first read).

    Attributes:
        order: int64 [N_p] occurrences sorted by row, stable.
        sorted_rows: int32 or int64 [N_p] the rows in that order (the sort's keys).
        unique_rows: int64 [U] ascending.
        segments: int64 [U+1]: the occurrences of ``unique_rows[u]`` are
            ``order[segments[u]:segments[u+1]]``.
    """

    def __init__(
        self, order: Tensor | None, sorted_rows: Tensor | None, sort: PackSort | None = None
    ) -> None:
        self._order = order
        self._sorted_rows = sorted_rows
        self._sort = sort
        self._unique: tuple[Tensor, Tensor] | None = None

    @property
    def order(self) -> Tensor:
        self._sorted()
        return self._order

    @property
    def sorted_rows(self) -> Tensor:
        self._sorted()
        return self._sorted_rows

    def _sorted(self) -> None:
        if self._order is None:
            self._sort.run()

    @property
    def unique_rows(self) -> Tensor:
        return self._unique_and_segments()[0]

    @property
    def segments(self) -> Tensor:
        return self._unique_and_segments()[1]

    def __iter__(self) -> Iterator[Tensor]:
        yield self.order
        yield from self._unique_and_segments()

    def tensors(self) -> list[Tensor]:
        """The tensors made so far (what a consumer stream must mark as used)."""
        made = [t for t in (self._order, self._sorted_rows) if t is not None]
        return made + list(self._unique or ())

    def _unique_and_segments(self) -> tuple[Tensor, Tensor]:
        if self._unique is None:
            unique_rows, counts = torch.unique_consecutive(self.sorted_rows, return_counts=True)
            segments = torch.zeros(unique_rows.numel() + 1, dtype=torch.int64, device=counts.device)
            torch.cumsum(counts, 0, out=segments[1:])
            self._unique = (unique_rows.long(), segments)
        return self._unique


def group_by_row(rows: Tensor, num_rows: int | None = None, *, unique: bool = True) -> RowGroups:
    """Groups a pack's id occurrences by packed row (the dedup step of every backward).

    A stable sort of the rows: with ``num_rows`` below 2^31 its keys are int32 (half the
    radix passes of int64 on CUDA, the same order: a stable sort's permutation depends
    only on the keys' values). ``unique=False`` leaves the unique rows and segments
    (whose size U needs a host synchronization) to the first reader, for a backward that
    reads only the order (the Triton occurrence tiles): the grouping then runs without
    synchronizing with the host.

    Args:
        rows: int32 or int64 [N_p] packed row of each occurrence, in ``[0, num_rows)``.
        num_rows: The pack's rows, or None when unknown (keys of the rows' dtype).
        unique: Make ``unique_rows`` and ``segments`` now.

    Returns:
        (order, unique_rows, segments): see :class:`RowGroups`.
    """
    keys = rows.int() if num_rows is not None and num_rows <= INT32_ROWS else rows
    sorted_rows, order = torch.sort(keys, stable=True)
    groups = RowGroups(order, sorted_rows)
    if unique:
        groups.unique_rows  # noqa: B018 (made now, on the preparing stream)
    return groups


class PackSort:
    """The row groupings of one batch's packs, made by one sort (:func:`group_packs`) on CUDA.

    Packs queue their grouping (:meth:`group`) while a batch is prepared; :meth:`run`
    then sorts them all at once (a queued grouping read before that runs it). On CUDA
    that is one radix sort, linear in the ids, instead of one launch per pack; on the
    CPU, where the merge sort's N log N makes one sort of all the ids 15-35% slower than
    one sort per pack (measured with 2-5 packs of 2k-850k ids), each pack is sorted
    alone. Both give bitwise the same groupings.
    """

    def __init__(self) -> None:
        self._queued: list[tuple[Tensor, int, bool, RowGroups, AfterSort | None]] = []

    def group(self, rows: Tensor, num_rows: int, unique: bool, then: AfterSort | None = None) -> RowGroups:
        """Queues :func:`group_by_row` of ``rows`` (a pack of ``num_rows`` rows); ``then`` is
        called with the grouping right after the sort (on the stream that runs it)."""
        groups = RowGroups(None, None, self)
        self._queued.append((rows, num_rows, unique, groups, then))
        return groups

    @staticmethod
    def one_sort(device: torch.device) -> bool:
        """Whether the packs' ids on ``device`` are sorted together (CUDA) or pack by pack."""
        return device.type == "cuda"

    def run(self) -> None:
        """Sorts every queued grouping (one sort; none when nothing is queued)."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        rows, num_rows = [q[0] for q in queued], [q[1] for q in queued]
        if self.one_sort(rows[0].device):
            made = group_packs(rows, num_rows, [False] * len(queued))
        else:
            made = [group_by_row(r, n, unique=False) for r, n in zip(rows, num_rows)]
        # Every grouping gets its order first: a 'then' that raises leaves none unsorted.
        for (_, _, _, groups, _), done in zip(queued, made):
            groups._order, groups._sorted_rows = done.order, done.sorted_rows
        for _, _, unique, groups, then in queued:
            if unique:
                groups.unique_rows  # noqa: B018 (made now, on the preparing stream)
            if then is not None:
                then(groups)


def group_packs(rows: list[Tensor], num_rows: list[int], unique: list[bool]) -> list[RowGroups]:
    """:func:`group_by_row` of several packs' occurrences with one sort for all of them.

    The packs' rows are concatenated, each shifted by the rows of the packs before it
    (int32 keys when all the packs' rows fit), and sorted once, stably: pack ``p``'s keys
    lie above every earlier pack's and below every later one's, so its occurrences come
    out together, at the place they went in, in the order of its own stable sort. The
    result is bitwise that of one :func:`group_by_row` per pack. No host synchronization
    (the split points are the packs' id counts, known on the host).

    Args:
        rows: Per pack, int32 or int64 [N_p] packed row of each occurrence.
        num_rows: Per pack, its rows R_p.
        unique: Per pack, make ``unique_rows`` and ``segments`` now (see :func:`group_by_row`).

    Returns:
        One :class:`RowGroups` per pack.
    """
    if len(rows) == 1:
        return [group_by_row(rows[0], num_rows[0], unique=unique[0])]
    key_dtype = torch.int32 if sum(num_rows) <= INT32_ROWS else torch.int64
    bases = [sum(num_rows[:p]) for p in range(len(rows))]
    keys = torch.cat([r.to(key_dtype) + base if base else r.to(key_dtype) for r, base in zip(rows, bases)])
    sorted_keys, order = torch.sort(keys, stable=True)
    groups, start = [], 0
    for r, rows_p, base, make_unique in zip(rows, num_rows, bases, unique):
        n = r.numel()
        # The keys of one group_by_row: int32 where the pack's rows fit, else the rows' dtype.
        own = torch.int32 if rows_p <= INT32_ROWS else r.dtype
        group = RowGroups(order[start : start + n] - start, (sorted_keys[start : start + n] - base).to(own))
        if make_unique:
            group.unique_rows  # noqa: B018 (made now, on the preparing stream)
        groups.append(group)
        start += n
    return groups
