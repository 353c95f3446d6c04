"""Packing: many tables become a few packed buffers, and a batch's ids are routed to them.

Tables with the same dim, optimizer and placement share one packed buffer [sum R, D]; table ``t``
of a pack owns rows ``row_offset[t] .. row_offset[t] + R_t - 1``. A feature's id ``i``
therefore reads packed row ``row_offset[table(feature)] + i``.

Shapes: B batch, F features in a SparseFeatures, S features of one pack (its "local"
features), N ids, D dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.errors import ConfigError, DataError
from recaccel.ops.embedding.row_groups import INT32_ROWS
from recaccel.ops.embedding.specs import TableSpec
from recaccel.sparse import SparseFeatures
from recaccel.sparse.csr import run_of, runs_index


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
                wide_rows=layout.num_rows > INT32_ROWS,
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
    # Feature-major ids: per-bag quantities reach them by repeat_interleave, a linear pass
    # (a one-hot batch's whole-batch pack: id i is bag i), per-feature ones by _per_id_of_feature.
    bags = None
    if with_bags and sf.one_hot and local.identity:
        bags = torch.arange(n, device=device)
    elif with_bags:
        bags = torch.repeat_interleave(torch.arange(s * b, device=device), lengths, output_size=n)
    needs_per_id = b > 0 and (local.limit is not None or local.any_shift)
    per_id = _per_id_of_feature(offsets, bags, b, n) if needs_per_id else None
    bad = None
    if local.limit is not None and b > 0:
        # Deferred bounds check: an id outside its table reads (and updates) the table's
        # row 0, as the forward kernel does, never another table's row or past the buffer.
        limit = per_id(local.limit)
        ok = (values >= 0) & (values < limit)
        values = torch.where(ok, values, 0)
        bad = (n - ok.sum(dtype=torch.int32)).reshape(1)
    rows = values
    if local.any_shift and b > 0:
        rows = values + per_id(local.row_offset.to(index))
    scale = None if weights is None else weights.to(torch.float32)
    if local.any_mean:
        inv_len = 1.0 / lengths.clamp(min=1).to(torch.float32)
        bag_scale = torch.where(local.is_mean.repeat_interleave(b), inv_len, torch.ones_like(inv_len))
        mean_scale = torch.repeat_interleave(bag_scale, lengths, output_size=n)
        scale = mean_scale if scale is None else scale * mean_scale
    return PackIds(rows, offsets, scale, bags, bad)


def _per_id_of_feature(
    offsets: Tensor, bags: Tensor | None, b: int, n: int, gather: bool | None = None
) -> Callable[[Tensor], Tensor]:
    """Spreads a per-feature value [S] over the pack's feature-major ids [N] (``offsets``
    [S*B + 1] of its bags; ``bags`` [N], each id's bag, or None). On the CPU a
    ``repeat_interleave`` over the features' id counts, a linear pass; on CUDA (``gather``
    None: ``offsets``' device decides) that op writes a feature's ids with one warp (26 warps
    for 1.7 M ids: ~0.09 ms on the H200), so each id's feature is found once (its bag // B,
    or its run among the features': :func:`~recaccel.sparse.csr.run_of`) and the values
    gathered through it."""
    on_cuda = offsets.is_cuda if gather is None else gather
    if on_cuda and bags is not None:
        feature = bags // b
    else:
        counts = offsets[b::b] - offsets[:-1:b]  # [S] each feature's ids
        if not on_cuda:
            return lambda per_feature: torch.repeat_interleave(per_feature, counts, output_size=n)
        feature = run_of(counts, n, search=True)
    return lambda per_feature: per_feature.index_select(0, feature)


class PackIdCounts:
    """The number of ids each pack takes from one batch, read from the device at most
    once for all packs (one host synchronization), and only when a pack asks.

    A batch whose features all go to one pack needs no read: that pack takes every id;
    nor does a batch whose field counts the host knows (one-hot, or brought from host
    memory by the device loader: :attr:`SparseFeatures.known_field_counts`).

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
        known = sf.known_field_counts
        if known is not None:
            return [sum(known[f] for f in route.features) for route in routing.packs]
        b, f = sf.batch_size, len(routing.keys)
        offsets = sf.offsets.long()
        per_feature = offsets[b : (f + 1) * b : b] - offsets[: f * b : b]  # [F]
        pack_of = torch.empty(f, dtype=torch.int64)
        for p, route in enumerate(routing.packs):
            pack_of[route.features] = p
        counts = torch.zeros(len(routing.packs), dtype=torch.int64, device=offsets.device)
        counts.index_add_(0, pack_of.to(offsets.device), per_feature)
        return counts.tolist()  # the one read of every pack's count


def index_dtype(sf: SparseFeatures, local: LocalFeatures) -> torch.dtype:
    """The dtype of a pack's ids and offsets: int32 when the batch's ids and offsets are
    both int32 and the pack's rows fit (no cast on the way to the kernels), else int64."""
    narrow = sf.values.dtype == torch.int32 and sf.offsets.dtype == torch.int32 and not local.wide_rows
    return torch.int32 if narrow else torch.int64


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
    # Each kept id moves from its feature's first kept position to that feature's base: S runs
    # (on CUDA found by a search, not repeat_interleave's one warp per feature).
    gather = runs_index(bounds[:, 0].long(), counts.long(), n)
    scale = None if ids.scale is None else ids.scale.index_select(0, gather)
    return PackIds(ids.rows.index_select(0, gather), offsets.to(ids.offsets.dtype), scale, None)


def check_one_dim(routing: Routing, method: str) -> None:
    """Raises ValueError when the batch's features have several dims (``method`` of
    :class:`~recaccel.ops.embedding.module.PackedEmbeddingBag` needs one)."""
    if len(set(routing.dims)) > 1:
        raise ValueError(
            f"PackedEmbeddingBag.{method} needs one dim for all features, got dims {sorted(set(routing.dims))}; "
            "use forward_packs() or forward_concat()"
        )
