"""A training batch's pack ids in one pass: rows, bags, scales and the bounds check.

:func:`~recaccel.ops.embedding.packing.gather_pack_ids` (the reference, every backend's)
builds what the backward needs of a pack that takes the batch's CSR as is with about ten
passes over the ids: each id's bag (``repeat_interleave``), its feature (``bags // B``),
its table's size and row offset gathered through it, the range test, the replacement of
bad ids, their count, the shift. At T=26 B=16,384 L=20 (8.5 M ids) that is about 1.2 GB
moved and a dozen launches per step. ``_pack_ids_kernel`` writes the same rows, bags and
scales reading each id once: program ``i`` takes ids ``i*BLOCK ..``, finds each one's bag
by a binary search among the bags' offsets (``SEARCH_STEPS`` levels; neighbouring ids
share their path, so the loads hit the cache), its feature as ``bag // B``, and counts
its bad ids into one device counter (an integer ``atomic_add`` a program: the same count
whatever the order). A one-hot batch skips the search (id ``i`` is bag ``i``).

Same integers as the reference, bit for bit (tested under ``TRITON_INTERPRET=1``); the
scale is the id's weight times ``1/L`` under mean pooling, each a single float32 product
as in the reference.

Shapes: B batch, S features of the pack, N ids of the pack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recaccel.ops.embedding.packing import LocalFeatures, PackIds, index_dtype
from recaccel.ops.embedding.prepared import PackBatch
from recaccel.sparse import SparseFeatures

BLOCK = 1024  # ids a program


@triton.jit
def _pack_ids_kernel(
    values_ptr,  # int32/int64 [N] the batch's ids
    offsets_ptr,  # int32/int64 [S*B + 1] the batch's CSR
    weights_ptr,  # float32 [N] per-id weights (unread without HAS_WEIGHTS)
    limit_ptr,  # int64 [S] table sizes (unread without CHECK)
    row_offset_ptr,  # int64 [S] packed-row shift of each feature (unread without SHIFT)
    is_mean_ptr,  # bool [S] mean pooling (unread without HAS_MEAN)
    rows_ptr,  # out, index dtype [N]
    bags_ptr,  # out, int64 [N] (unwritten without WRITE_BAGS)
    scale_ptr,  # out, float32 [N] (unwritten without HAS_WEIGHTS or HAS_MEAN)
    bad_ptr,  # out, int32 [1] bad-id count, added to (unwritten without CHECK)
    num_ids,
    num_bags,
    batch_size,
    CHECK: tl.constexpr,
    SHIFT: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    WRITE_BAGS: tl.constexpr,
    ONE_HOT: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    on = i < num_ids
    if ONE_HOT:
        bag = i
    else:
        # The last bag whose start is <= i: empty bags before it share its start.
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = tl.zeros([BLOCK], dtype=tl.int64) + num_bags
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            at_or_before = tl.load(offsets_ptr + mid, mask=on, other=0) <= i  # mid < hi <= num_bags
            lo = tl.where(at_or_before, mid, lo)
            hi = tl.where(at_or_before, hi, mid)
        bag = lo
    feature = bag // batch_size
    ids = tl.load(values_ptr + i, mask=on, other=0).to(tl.int64)
    if CHECK:
        limit = tl.load(limit_ptr + feature, mask=on, other=1)
        ok = (ids >= 0) & (ids < limit)
        ids = tl.where(ok, ids, 0)
        bad = tl.sum((on & (ok == 0)).to(tl.int32), axis=0)
        tl.atomic_add(bad_ptr, bad, mask=bad > 0)  # most programs add nothing: no atomic
    if SHIFT:
        ids += tl.load(row_offset_ptr + feature, mask=on, other=0)
    tl.store(rows_ptr + i, ids.to(rows_ptr.dtype.element_ty), mask=on)
    if WRITE_BAGS:
        tl.store(bags_ptr + i, bag, mask=on)
    if HAS_WEIGHTS or HAS_MEAN:
        scale = tl.full([BLOCK], 1.0, tl.float32)
        if HAS_WEIGHTS:
            scale = tl.load(weights_ptr + i, mask=on, other=0.0)
        if HAS_MEAN:
            if ONE_HOT:
                length = tl.full([BLOCK], 1, tl.int64)
            else:
                start = tl.load(offsets_ptr + bag, mask=on, other=0).to(tl.int64)
                length = tl.load(offsets_ptr + bag + 1, mask=on, other=1).to(tl.int64) - start
            # Correctly rounded, as torch divides (Triton's '/' on float32 is approximate).
            inv_len = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), tl.maximum(length, 1).to(tl.float32))
            mean = tl.load(is_mean_ptr + feature, mask=on, other=0) != 0
            if HAS_WEIGHTS:
                scale = tl.where(mean, scale * inv_len, scale)
            else:
                scale = tl.where(mean, inv_len, 1.0)
        tl.store(scale_ptr + i, scale, mask=on)


def fused_pack_ids(sf: SparseFeatures, local: LocalFeatures, batch_size: int, *, with_bags: bool) -> PackIds:
    """:func:`~recaccel.ops.embedding.packing.gather_pack_ids` of a pack that takes the
    batch's CSR as is (``local.identity``), in one launch; no host synchronization.

    Args:
        sf: The batch (S features, B rows): ids and offsets int32 or int64, contiguous.
        local: The pack's local features, ``identity``.
        batch_size: B (> 0).
        with_bags: Also write each id's bag.

    Returns:
        What the reference returns: rows and offsets in :func:`~recaccel.ops.embedding.packing.index_dtype`,
        scale, bags (int64) and the bad-id count with the deferred check.
    """
    if not local.identity or batch_size <= 0:
        raise ValueError("fused_pack_ids: a pack taking the batch's CSR as is, of a non-empty batch")
    index = index_dtype(sf, local)
    values, offsets = sf.values, sf.offsets.to(index)
    n, num_bags = values.numel(), local.count * batch_size
    device = values.device
    rows = torch.empty(n, dtype=index, device=device)
    bags = torch.empty(n, dtype=torch.int64, device=device) if with_bags else rows
    has_weights = sf.weights is not None
    scale = torch.empty(n, dtype=torch.float32, device=device) if has_weights or local.any_mean else None
    check = local.limit is not None
    bad = torch.zeros(1, dtype=torch.int32, device=device) if check else None
    if n:
        _pack_ids_kernel[(triton.cdiv(n, BLOCK),)](
            values,
            offsets,
            sf.weights if has_weights else rows,
            local.limit if check else local.row_offset,
            local.row_offset,
            local.is_mean,
            rows,
            bags,
            rows if scale is None else scale,
            rows if bad is None else bad,
            n,
            num_bags,
            batch_size,
            CHECK=check,
            SHIFT=local.any_shift,
            HAS_WEIGHTS=has_weights,
            HAS_MEAN=local.any_mean,
            WRITE_BAGS=with_bags,
            ONE_HOT=sf.one_hot,
            SEARCH_STEPS=1 if sf.one_hot else num_bags.bit_length(),  # one compile for one-hot batches
            BLOCK=BLOCK,
            num_warps=4,
        )
    return PackIds(rows, offsets, scale, bags if with_bags else None, bad)


def backward_pack_ids(batch: PackBatch) -> PackIds:
    """A training batch's pack ids with their bags, as the Triton backward reads them: one
    launch (:func:`fused_pack_ids`) when the pack takes the batch's CSR as is, else the
    reference's passes (a pack of some of the batch's features)."""
    if batch.local.identity:
        return fused_pack_ids(batch.sf, batch.local, batch.batch_size, with_bags=True)
    return batch.pack_ids(with_bags=True)
