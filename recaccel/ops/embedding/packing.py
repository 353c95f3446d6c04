"""Packing: many tables become a few packed buffers, and a batch's ids are routed to them.

Tables with the same dim, optimizer and placement share one packed buffer [sum R, D]; table ``t``
of a pack owns rows ``row_offset[t] .. row_offset[t] + R_t - 1``. A feature's id ``i``
therefore reads packed row ``row_offset[table(feature)] + i``.

Shapes: B batch, F features in a SparseFeatures, S features of one pack (its "local"
features), N ids, D dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.errors import ConfigError, DataError
from recaccel.ops.embedding.specs import InvalidIdError, TableSpec
from recaccel.sparse import SparseFeatures


@dataclass(frozen=True)
class PackLayout:
    """One packed buffer: tables of one dim, optimizer and placement, stacked by rows.

    Attributes:
        index: Position of the pack in the module.
        dim: D of every table in the pack.
        optimizer: The tables' sparse optimizer.
        tables: The tables, in the order of their rows.
        row_offsets: First packed row of each table.
        num_rows: Total rows (sum of the tables' R).
        placement: The tables' placement (``"device"`` or ``"host"``).
    """

    index: int
    dim: int
    optimizer: str
    tables: tuple[TableSpec, ...]
    row_offsets: tuple[int, ...]
    num_rows: int
    placement: str = "device"


@dataclass(frozen=True)
class FeatureSlot:
    """Where one feature's lookups go."""

    feature: str
    table: TableSpec
    pack: int
    row_offset: int


@dataclass
class LocalFeatures:
    """S features of one pack as its kernels see them (device tensors, cached per batch keys).

    Local feature ``j`` reads the SparseFeatures bags ``src[j]*B + b``; ``src[j] = -1``
    stands for a feature absent from the batch (all its bags are empty).

    Attributes:
        src: int64 [S] feature index in the batch, or -1.
        row_offset: int64 [S] packed-row shift of each feature's ids.
        is_mean: bool [S] mean pooling.
        count: S.
        identity: ``src`` is ``0..F-1``: the batch's CSR is used as is.
        any_mean: some feature pools by mean.
        any_shift: some row offset is non-zero.
        any_missing: some ``src`` is -1.
        limit: int64 [S] table size of each local feature when the ids are checked by
            the kernels (a module's deferred bounds check: an id outside ``[0, limit)``
            reads row 0 of its table and is counted), else None.
        wide_rows: The pack has more than 2^31 rows: its packed rows need int64 even
            when the batch's ids are int32.
        whole_batch: ``src`` is a permutation of ``0..F-1``: the pack takes every id of
            the batch, so its number of ids is the batch's, known without reading the
            offsets.
    """

    src: Tensor
    row_offset: Tensor
    is_mean: Tensor
    count: int
    identity: bool
    any_mean: bool
    any_shift: bool
    any_missing: bool
    limit: Tensor | None = None
    wide_rows: bool = False
    whole_batch: bool = False

    @classmethod
    def build(
        cls,
        src: list[int],
        row_offset: list[int],
        is_mean: list[bool],
        num_keys: int,
        device: torch.device,
        limit: list[int] | None = None,
        *,
        wide_rows: bool = False,
    ) -> LocalFeatures:
        as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
        return cls(
            src=as_long(src),
            row_offset=as_long(row_offset),
            is_mean=torch.tensor(is_mean, dtype=torch.bool, device=device),
            count=len(src),
            identity=src == list(range(num_keys)),
            any_mean=any(is_mean),
            any_shift=any(r != 0 for r in row_offset),
            any_missing=any(s < 0 for s in src),
            limit=None if limit is None else as_long(limit),
            wide_rows=wide_rows,
            whole_batch=sorted(src) == list(range(num_keys)),
        )


@dataclass
class PackRoute:
    """How the features of one batch's keys reach one pack.

    Attributes:
        features: Batch feature indices in this pack, in batch order (F_p of them).
        local: Those features, for the reference and Triton kernels.
        slots: Every feature the pack's tables declare, grouped by table (FBGEMM's
            feature order), absent ones with ``src = -1``; ids are not shifted.
        slot_of_local: int64 [F_p] slot of each local feature.
    """

    features: list[int]
    local: LocalFeatures
    slots: LocalFeatures
    slot_of_local: Tensor


@dataclass
class Routing:
    """Everything about a batch's keys that does not depend on its ids.

    Attributes:
        keys: The batch's feature names.
        packs: One route per pack.
        num_rows: int64 [F] table size of each feature (for the bounds check).
        dims: D of each feature.
        restore: int64 [F] position of each batch feature in the packs' outputs
            concatenated along the feature axis, or None when that is already batch order.
        restore_columns: int64 [sum D] the same for the packs' outputs flattened to
            [B, F_p*D_p] and concatenated, or None.
        order: int64 [F] the inverse of ``restore``: the batch feature at each position of
            the packs' concatenated outputs (what a gradient in batch order is gathered
            by to reach the packs), or None with ``restore``.
    """

    keys: tuple[str, ...]
    packs: list[PackRoute]
    num_rows: Tensor
    dims: list[int]
    restore: Tensor | None
    restore_columns: Tensor | None
    order: Tensor | None = None

    def to_batch_order(self, outs: list[Tensor]) -> Tensor:
        """The packs' [B, F_p, D] outputs as one [B, F, D] in the batch's feature order."""
        outs = [o for o in outs if o.shape[1] > 0]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out if self.restore is None else out.index_select(1, self.restore)


@dataclass
class PackIds:
    """One pack's ids in CSR over its S local features, ready for an embedding bag.

    ``rows`` and ``offsets`` share one index dtype (what ``embedding_bag`` and FBGEMM's
    TBE ask): int32 when the batch's ids and offsets are both int32 and the pack's rows
    fit, else int64 (:func:`gather_pack_ids`).

    Attributes:
        rows: int32 or int64 [N_p] packed row of each id.
        offsets: [S*B+1], the dtype of ``rows``: bag ``j*B + b`` holds
            ``rows[offsets[j*B+b]:offsets[j*B+b+1]]``.
        scale: float32 [N_p] per-id multiplier (the id's weight, times ``1/L`` under mean
            pooling), or None for all ones.
        bags: int64 [N_p] bag of each id, or None when not asked for.
        bad: With the deferred bounds check (``LocalFeatures.limit``), int32 [1] the
            number of ids outside their table (each replaced by its table's row 0), made
            on the device; else None.
    """

    rows: Tensor
    offsets: Tensor
    scale: Tensor | None
    bags: Tensor | None
    bad: Tensor | None = None


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


class PackingPlan:
    """Groups tables into packs and maps feature names to their pack and row offset.

    Args:
        tables: The tables; packs follow the order in which each (dim, optimizer,
            placement) first appears, and tables keep their order inside a pack.

    Raises:
        ConfigError: duplicate table names, or a feature claimed by two tables.
    """

    def __init__(self, tables: list[TableSpec]) -> None:
        if not tables:
            raise ConfigError("a packed embedding bag needs at least one table")
        names = [t.name for t in tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"duplicate table names: {dup}")
        groups: dict[tuple[int, str, str], list[TableSpec]] = {}
        for t in tables:
            groups.setdefault((t.dim, t.optimizer, t.placement), []).append(t)
        self.packs: list[PackLayout] = []
        self.slots: dict[str, FeatureSlot] = {}
        for p, ((dim, optimizer, placement), members) in enumerate(groups.items()):
            offsets, total = [], 0
            for t in members:
                offsets.append(total)
                for f in t.features:
                    if f in self.slots:
                        raise ConfigError(
                            f"feature {f!r} is claimed by tables {self.slots[f].table.name!r} and {t.name!r}"
                        )
                    self.slots[f] = FeatureSlot(f, t, p, total)
                total += t.num_rows
            self.packs.append(PackLayout(p, dim, optimizer, tuple(members), tuple(offsets), total, placement))

    def route(
        self, keys: list[str] | tuple[str, ...], device: torch.device, *, check_in_kernels: bool = False
    ) -> Routing:
        """Routes a batch's features to the packs.

        Args:
            keys: The batch's feature names.
            device: Where the routing's tensors live.
            check_in_kernels: Give each pack's local features their tables' sizes
                (``LocalFeatures.limit``): the deferred bounds check.

        Raises:
            DataError: a key no table declares, or a repeated key.
        """
        keys = tuple(keys)
        seen: set[str] = set()
        for k in keys:
            if k not in self.slots:
                raise DataError(
                    f"sparse feature {k!r} is looked up by no table; known features: {sorted(self.slots)}",
                    column=k,
                )
            if k in seen:
                raise DataError(f"sparse feature {k!r} appears twice in the batch's keys", column=k)
            seen.add(k)
        index = {k: i for i, k in enumerate(keys)}
        routes, order = [], []
        for layout in self.packs:
            feats = [i for i, k in enumerate(keys) if self.slots[k].pack == layout.index]
            local = LocalFeatures.build(
                feats,
                [self.slots[keys[i]].row_offset for i in feats],
                [self.slots[keys[i]].table.pooling == "mean" for i in feats],
                len(keys),
                device,
                [self.slots[keys[i]].table.num_rows for i in feats] if check_in_kernels else None,
                wide_rows=layout.num_rows > _INT32_ROWS,
            )
            declared = [f for t in layout.tables for f in t.features]
            slots = LocalFeatures.build(
                [index.get(f, -1) for f in declared],
                [0] * len(declared),
                [self.slots[f].table.pooling == "mean" for f in declared],
                len(keys),
                device,
            )
            slot_of = torch.tensor([declared.index(keys[i]) for i in feats], dtype=torch.int64, device=device)
            routes.append(PackRoute(feats, local, slots, slot_of))
            order.extend(feats)
        dims = [self.slots[k].table.dim for k in keys]
        restore = restore_cols = gather = None
        if order != list(range(len(keys))):
            pos = {f: j for j, f in enumerate(order)}
            restore = torch.tensor([pos[f] for f in range(len(keys))], dtype=torch.int64, device=device)
            gather = torch.tensor(order, dtype=torch.int64, device=device)
            starts, col = {}, 0
            for f in order:
                starts[f] = col
                col += dims[f]
            cols = [c for f in range(len(keys)) for c in range(starts[f], starts[f] + dims[f])]
            restore_cols = torch.tensor(cols, dtype=torch.int64, device=device)
        num_rows = torch.tensor(
            [self.slots[k].table.num_rows for k in keys], dtype=torch.int64, device=device
        )
        return Routing(keys, routes, num_rows, dims, restore, restore_cols, gather)


def gather_pack_ids(
    sf: SparseFeatures,
    local: LocalFeatures,
    batch_size: int,
    *,
    with_bags: bool = False,
    num_ids: int | None = None,
) -> PackIds:
    """Selects, shifts and scales the ids of one pack's local features.

    No host synchronization when the pack's number of ids is known on the host: the
    batch's CSR as is, a pack that takes every feature of the batch, or ``num_ids``
    given; otherwise one (that number, read from the pack's offsets).

    Args:
        sf: The batch (F features, B rows).
        local: The pack's local features (S of them).
        batch_size: B.
        with_bags: Also return each id's bag.
        num_ids: The pack's number of ids N_p, when the caller knows it
            (:class:`PackIdCounts`).

    Returns:
        The pack's ids in CSR over ``S*B`` bags, rows and offsets in :func:`index_dtype`.
    """
    b, s = batch_size, local.count
    device = sf.values.device
    index = index_dtype(sf, local)
    values, batch_offsets, weights = sf.values.to(index), sf.offsets.to(index), sf.weights
    if local.identity:
        offsets = batch_offsets
        lengths = offsets[1:] - offsets[:-1]
        n = values.numel()
    else:
        # Bag j*B + b of the pack is bag src[j]*B + b of the batch.
        bag_src = (local.src.clamp(min=0)[:, None] * b + torch.arange(b, device=device)).reshape(-1)
        starts = batch_offsets.index_select(0, bag_src)
        lengths = batch_offsets.index_select(0, bag_src + 1) - starts
        if local.any_missing:
            lengths = lengths * (local.src >= 0).repeat_interleave(b)
        offsets = torch.zeros(s * b + 1, dtype=index, device=device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if num_ids is None:
            num_ids = values.numel() if local.whole_batch else int(offsets[-1])
        n = num_ids
        # Each id moves by (its bag's start in the batch) - (its bag's start in the pack).
        shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=n)
        gather = shift + torch.arange(n, device=device)
        values = values.index_select(0, gather)
        weights = None if weights is None else weights.index_select(0, gather)
    # The pack's ids are feature-major: per-feature and per-bag quantities reach them by
    # repeat_interleave, a linear pass, rather than by a gather through each id's bag.
    bags = None
    if with_bags:
        bags = torch.repeat_interleave(torch.arange(s * b, device=device), lengths, output_size=n)
    feat_counts = offsets[b::b] - offsets[: s * b : b] if b > 0 else None
    bad = None
    if local.limit is not None and b > 0:
        # Deferred bounds check: an id outside its table reads (and updates) the table's
        # row 0, as the forward kernel does, never another table's row or past the buffer.
        limit = torch.repeat_interleave(local.limit, feat_counts, output_size=n)
        ok = (values >= 0) & (values < limit)
        values = torch.where(ok, values, 0)
        bad = (n - ok.sum(dtype=torch.int32)).reshape(1)
    rows = values
    if local.any_shift and b > 0:
        rows = values + torch.repeat_interleave(local.row_offset.to(index), feat_counts, output_size=n)
    scale = None if weights is None else weights.to(torch.float32)
    if local.any_mean:
        inv_len = 1.0 / lengths.clamp(min=1).to(torch.float32)
        bag_scale = torch.where(local.is_mean.repeat_interleave(b), inv_len, torch.ones_like(inv_len))
        mean_scale = torch.repeat_interleave(bag_scale, lengths, output_size=n)
        scale = mean_scale if scale is None else scale * mean_scale
    return PackIds(rows, offsets, scale, bags, bad)


class PackIdCounts:
    """The number of ids each pack takes from one batch, read from the device at most
    once for all packs (one host synchronization), and only when a pack asks.

    A batch whose features all go to one pack needs no read: that pack takes every id.

    Args:
        sf: The batch (F features, B rows), its offsets valid (checked or clamped).
        routing: Its routing.
    """

    def __init__(self, sf: SparseFeatures, routing: Routing) -> None:
        self._sf = sf
        self._routing = routing
        self._counts: list[int] | None = None

    def __call__(self, p: int) -> int | None:
        """Pack ``p``'s number of ids, or None when the pack computes it without a read."""
        if self._routing.packs[p].local.whole_batch:
            return None
        if self._counts is None:
            self._counts = self._read()
        return self._counts[p]

    def _read(self) -> list[int]:
        sf, routing = self._sf, self._routing
        b, f = sf.batch_size, len(routing.keys)
        offsets = sf.offsets.long()
        per_feature = offsets[b : (f + 1) * b : b] - offsets[: f * b : b]  # [F]
        pack_of = torch.empty(f, dtype=torch.int64)
        for p, route in enumerate(routing.packs):
            pack_of[route.features] = p
        counts = torch.zeros(len(routing.packs), dtype=torch.int64, device=offsets.device)
        counts.index_add_(0, pack_of.to(offsets.device), per_feature)
        return counts.tolist()  # the one read of every pack's count


_INT32_ROWS = 2**31  # packed rows below this fit int32 sort keys


def index_dtype(sf: SparseFeatures, local: LocalFeatures) -> torch.dtype:
    """The dtype of a pack's ids and offsets: int32 when the batch's ids and offsets are
    both int32 and the pack's rows fit (no cast on the way to the kernels), else int64."""
    narrow = sf.values.dtype == torch.int32 and sf.offsets.dtype == torch.int32 and not local.wide_rows
    return torch.int32 if narrow else torch.int64


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
    keys = rows.int() if num_rows is not None and num_rows <= _INT32_ROWS else rows
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
        self._queued: list[tuple[Tensor, int, bool, RowGroups]] = []

    def group(self, rows: Tensor, num_rows: int, unique: bool) -> RowGroups:
        """Queues :func:`group_by_row` of ``rows`` (a pack of ``num_rows`` rows)."""
        groups = RowGroups(None, None, self)
        self._queued.append((rows, num_rows, unique, groups))
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
        for (_, _, unique, groups), done in zip(queued, made):
            groups._order, groups._sorted_rows = done.order, done.sorted_rows
            if unique:
                groups.unique_rows  # noqa: B018 (made now, on the preparing stream)


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
    key_dtype = torch.int32 if sum(num_rows) <= _INT32_ROWS else torch.int64
    bases = [sum(num_rows[:p]) for p in range(len(rows))]
    keys = torch.cat([r.to(key_dtype) + base if base else r.to(key_dtype) for r, base in zip(rows, bases)])
    sorted_keys, order = torch.sort(keys, stable=True)
    groups, start = [], 0
    for r, rows_p, base, make_unique in zip(rows, num_rows, bases, unique):
        n = r.numel()
        # The keys of one group_by_row: int32 where the pack's rows fit, else the rows' dtype.
        own = torch.int32 if rows_p <= _INT32_ROWS else r.dtype
        group = RowGroups(order[start : start + n] - start, (sorted_keys[start : start + n] - base).to(own))
        if make_unique:
            group.unique_rows  # noqa: B018 (made now, on the preparing stream)
        groups.append(group)
        start += n
    return groups


def slice_pack_ids(ids: PackIds, batch_size: int, num_local: int, lo: int, hi: int) -> PackIds:
    """The ids of batch rows ``lo .. hi-1`` of one pack, as the CSR of a batch of ``hi - lo`` rows.

    Rows, offsets' differences and scales are copied unchanged (a mean's ``1/L`` stays that
    of the whole bag), so pooling the result gives those rows of the whole batch's
    pooling, bag for bag. One host synchronization (the number of ids).

    Args:
        ids: The pack's ids over ``S*B`` bags (``bags`` unused).
        batch_size: B.
        num_local: S.
        lo: First row, ``0 <= lo <= hi <= B``.
        hi: One past the last row.

    Returns:
        The pack's ids over ``S*(hi-lo)`` bags, feature-major, in the ids' index dtype;
        ``bags`` None.
    """
    rows = hi - lo
    device = ids.rows.device
    first = torch.arange(num_local, device=device) * batch_size + lo  # [S] first bag of each feature
    bounds = ids.offsets.index_select(0, (first[:, None] + torch.arange(rows + 1, device=device)).reshape(-1))
    bounds = bounds.view(num_local, rows + 1)
    counts = bounds[:, -1] - bounds[:, 0]  # [S] ids of each feature in the rows
    base = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=base[1:])
    n = int(base[-1])
    offsets = torch.cat([(bounds[:, :-1] - bounds[:, :1] + base[:-1, None]).reshape(-1), base[-1:]])
    # Each kept id moves from its feature's first kept position to that feature's base.
    gather = torch.repeat_interleave(bounds[:, 0] - base[:-1], counts, output_size=n)
    gather += torch.arange(n, device=device)
    scale = None if ids.scale is None else ids.scale.index_select(0, gather)
    return PackIds(ids.rows.index_select(0, gather), offsets.to(ids.offsets.dtype), scale, None)


def check_batch(sf: SparseFeatures, routing: Routing, plan: PackingPlan) -> None:
    """Validates a batch's CSR and ids with one host synchronization.

    Raises:
        InvalidIdError: offsets that do not start at 0, end at ``len(values)`` and never
            decrease; or an id < 0 or >= its feature's table size (naming the feature,
            its table, the id and the batch row).
    """
    values, offsets = sf.values, sf.offsets
    n, f = values.numel(), len(routing.keys)
    b = sf.batch_size
    diffs = offsets[1:] - offsets[:-1]
    bad_offsets = (offsets[0] != 0) | (offsets[-1] != n) | (diffs < 0).any()
    if b == 0 or n == 0:
        bad_ids = torch.zeros((), dtype=torch.bool, device=values.device)
        id_feat = None
    else:
        # id_feat[i] = number of features 1..F-1 starting at or before id i: a count, not a
        # search, so it is linear and stays in [0, F-1] even if the offsets are malformed.
        feat_start = offsets[b : f * b : b].clamp(0, n).long()
        marks = torch.zeros(n + 1, dtype=torch.int64, device=values.device)
        marks.index_add_(0, feat_start, torch.ones_like(feat_start))
        id_feat = marks[:n].cumsum(0)
        bad_mask = (values < 0) | (values >= routing.num_rows.index_select(0, id_feat))
        bad_ids = bad_mask.any()
    if not bool(bad_offsets | bad_ids):
        return
    if bool(bad_offsets):
        raise InvalidIdError(
            f"malformed sparse offsets for features {list(routing.keys)}: they must start at 0, never "
            f"decrease and end at len(values)={n}; got first={int(offsets[0])}, last={int(offsets[-1])}"
        )
    i = int(torch.nonzero(bad_mask)[0, 0])
    feat = int(id_feat[i])
    bag = int(torch.searchsorted(offsets, torch.tensor(i, device=offsets.device), right=True)) - 1
    name = routing.keys[feat]
    table = plan.slots[name].table
    raise InvalidIdError(
        f"feature {name!r}: id {int(values[i])} at batch row {bag - feat * b} is out of range "
        f"[0, {table.num_rows}) of table {table.name!r}",
        column=name,
    )
