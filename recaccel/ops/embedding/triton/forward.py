"""Triton packed embedding bag forward as bag tiles, with a separate path for long bags.

Kernels (launcher :func:`embedding_bag_forward` below them):

- ``_bag_tile_kernel``: program ``(i, j)`` pools the ``BLOCK_BAGS`` consecutive bags
  ``i*BLOCK_BAGS ..`` of local feature ``j`` across all ``D`` columns. Grid
  ``(cdiv(rows, BLOCK_BAGS), S)``, bag blocks fastest, so programs resident together read
  one table and contiguous offsets and ids. It keeps a ``[BLOCK_BAGS, BLOCK_D]`` float32 sum
  in registers and walks bag positions ``0 .. max length - 1`` of its short bags,
  ``UNROLL`` positions per iteration: ``BLOCK_BAGS * UNROLL`` independent row loads in
  flight, each row a contiguous ``D``-vector whose offset carries a divisibility hint
  (``W_VEC``) so that loads vectorise to 16 bytes. The sum runs over loop iterations, not
  across lanes: no shared-memory reduction per step.
- ``_long_bag_kernel``: bags longer than ``long_threshold`` would keep a tile looping
  with every other lane masked, so the tile kernel skips them and this second launch
  pools them: program ``(i, j, d)`` scans the lengths of ``SCAN_BAGS`` bags of feature
  ``j`` and pools each long one in turn over columns block ``d``, ``CHUNK`` of its rows
  per step (every lane loads a row: none idles). Programs without a long bag exit after
  one load of offsets. The launch is skipped when the batch has too few ids for any bag
  to be long (known on the host: no synchronisation). One program per long bag and
  column block, not a split over programs: a split needs the long bags' list (a host
  synchronisation or a device-side compaction) and a second reduction pass, which pays
  only for bags of many thousands of ids, rare in a forward.

Equivalence with :func:`recaccel.ops.embedding.reference.reference_lookup`: both sum the
rows of a bag in float32, the id's weight applied to each row; the reference multiplies
by ``weight / L`` per id under mean pooling where this divides the weighted sum by ``L``
once, and sums in a different order, so results agree to float32 rounding (a few ulps
of the sum of absolute values), not bitwise. Within this module, a bag's result depends
only on the bag and the config (a short bag is summed position by position in order,
whatever ``BLOCK_BAGS`` and ``UNROLL``; a long one in ``CHUNK`` steps), so
:func:`embedding_bag_forward_rows` reproduces rows of :func:`embedding_bag_forward` bit
for bit. An empty bag pools to zeros; a feature with ``src = -1`` (absent) too.

Configs (``BLOCK_BAGS``, ``num_warps``, ``UNROLL``, long threshold) come from
:func:`forward_config`, keyed by ``(D, length bucket, dtype)``: :data:`FORWARD_TABLE`
overrides the defaults (filled by a tuning run); nothing autotunes at run time, so the
interpreter runs one config.

Shapes: B batch, S features of the pack, D dim, R packed rows, N ids of the batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel.errors import RecaccelError
from recaccel.ops.backend import check_triton_launchable
from recaccel.ops.embedding.packing import LocalFeatures
from recaccel.ops.embedding.triton import tuning
from recaccel.ops.tuning_tables import check_entry
from recaccel.sparse import SparseFeatures

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _bag_bounds(src_ptr, offsets_ptr, j, r, num_rows, batch_size, row_lo):
    """First id and length of the bags of rows ``row_lo + r`` of local feature ``j``
    (length 0 past ``num_rows`` and for a feature absent from the batch)."""
    src = tl.load(src_ptr + j)
    in_range = (r < num_rows) & (src >= 0)
    bag = src * batch_size + row_lo + r
    start = tl.load(offsets_ptr + bag, mask=in_range, other=0)
    length = tl.load(offsets_ptr + bag + 1, mask=in_range, other=0) - start
    return start, length


@triton.jit
def _bag_tile_kernel(
    weight_ptr,  # float32, bfloat16 or float16 [R, D], unit column stride
    values_ptr,  # int32 or int64 [N] the batch's ids
    offsets_ptr,  # int32 or int64 [F*B+1] the batch's CSR, feature-major
    id_weights_ptr,  # float32 [N] (read only if HAS_WEIGHTS)
    src_ptr,  # int64 [S] batch feature of each local feature, -1 if absent
    row_offset_ptr,  # int64 [S] packed-row shift of each local feature
    is_mean_ptr,  # bool [S] (read only if HAS_MEAN)
    limit_ptr,  # int64 [S] table size of each local feature (read only if CHECK)
    bad_ptr,  # int32 [1] count of out-of-range ids (added to only if CHECK)
    out_ptr,  # float32, bfloat16 or float16 [rows, S, D], unit column stride
    batch_size,  # B of the CSR
    row_lo,  # first batch row pooled
    num_rows,  # batch rows pooled
    long_threshold,  # bags longer than this are left to _long_bag_kernel
    stride_w,
    stride_ob,
    stride_of,
    DIM: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    CHECK: tl.constexpr,  # ids outside [0, limit) read row 0 of their table and are counted
    BLOCK_BAGS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNROLL: tl.constexpr,
    W_VEC: tl.constexpr,  # power of two dividing every row offset (elements)
    O_VEC: tl.constexpr,  # power of two dividing every output row offset (elements)
):
    j = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_BAGS + tl.arange(0, BLOCK_BAGS)
    start, length = _bag_bounds(src_ptr, offsets_ptr, j, r, num_rows, batch_size, row_lo)
    short = length <= long_threshold
    walk = tl.where(short, length, 0)
    shift = tl.load(row_offset_ptr + j)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < DIM
    acc = tl.zeros([BLOCK_BAGS, BLOCK_D], dtype=tl.float32)
    if CHECK:
        limit = tl.load(limit_ptr + j)
        num_bad = tl.zeros([BLOCK_BAGS], dtype=tl.int32)
    max_len = tl.max(walk, axis=0)
    # A while loop, not range(): the interpreter cannot take tensor bounds.
    pos = 0
    while pos < max_len:
        for u in tl.static_range(UNROLL):
            live = (pos + u) < walk
            at = start + pos + u
            # int32 or int64 ids alike: the row arithmetic is int64 either way.
            ids = tl.load(values_ptr + at, mask=live, other=0).to(tl.int64)
            if CHECK:
                ok = (ids >= 0) & (ids < limit)
                num_bad += (live & (ok == 0)).to(tl.int32)
                ids = tl.where(ok, ids, 0)
            row_off = tl.multiple_of((ids + shift) * stride_w, W_VEC)
            # The row mask is rebuilt, not live[:, None]: Triton 3.6's layout pass fails
            # on one i1 tensor masking both a 1-D and a 2-D load.
            rows = tl.load(
                weight_ptr + row_off[:, None] + cols[None, :],
                mask=((pos + u) < walk[:, None]) & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_WEIGHTS:
                w = tl.load(id_weights_ptr + at, mask=live, other=0.0)
                rows = rows * w[:, None]
            acc += rows
        pos += UNROLL
    if CHECK:
        bad = tl.sum(num_bad, axis=0)
        tl.atomic_add(bad_ptr, bad, mask=bad > 0)
    if HAS_MEAN:
        is_mean = tl.load(is_mean_ptr + j)
        denom = tl.where(is_mean, tl.maximum(length, 1), 1).to(tl.float32)
        acc = acc / denom[:, None]
    out_off = tl.multiple_of(r.to(tl.int64) * stride_ob + j * stride_of, O_VEC)
    tl.store(
        out_ptr + out_off[:, None] + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=((r < num_rows) & short)[:, None] & col_mask[None, :],
    )


@triton.jit
def _long_bag_kernel(
    weight_ptr,
    values_ptr,
    offsets_ptr,
    id_weights_ptr,
    src_ptr,
    row_offset_ptr,
    is_mean_ptr,
    limit_ptr,
    bad_ptr,
    out_ptr,
    batch_size,
    row_lo,
    num_rows,
    long_threshold,
    stride_w,
    stride_ob,
    stride_of,
    DIM: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    CHECK: tl.constexpr,
    SCAN_BAGS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    W_VEC: tl.constexpr,
):
    j = tl.program_id(1)
    idx = tl.arange(0, SCAN_BAGS)
    r = tl.program_id(0) * SCAN_BAGS + idx
    start, length = _bag_bounds(src_ptr, offsets_ptr, j, r, num_rows, batch_size, row_lo)
    pending = (length > long_threshold).to(tl.int32)
    shift = tl.load(row_offset_ptr + j)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < DIM
    chunk = tl.arange(0, CHUNK)
    if HAS_MEAN:
        is_mean = tl.load(is_mean_ptr + j)
    if CHECK:
        limit = tl.load(limit_ptr + j)
    while tl.max(pending, axis=0) > 0:
        k = tl.argmax(pending, axis=0)  # the first pending bag
        pick = idx == k
        first = tl.sum(tl.where(pick, start, 0), axis=0)
        n = tl.sum(tl.where(pick, length, 0), axis=0)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        pos = 0
        while pos < n:
            live = (pos + chunk) < n
            at = first + pos + chunk
            # int32 or int64 ids alike: the row arithmetic is int64 either way.
            ids = tl.load(values_ptr + at, mask=live, other=0).to(tl.int64)
            if CHECK:
                ok = (ids >= 0) & (ids < limit)
                # Counted by the first column block only: each id once.
                bad = tl.sum((live & (ok == 0)).to(tl.int32), axis=0)
                tl.atomic_add(bad_ptr, bad, mask=(bad > 0) & (tl.program_id(2) == 0))
                ids = tl.where(ok, ids, 0)
            row_off = tl.multiple_of((ids + shift) * stride_w, W_VEC)
            rows = tl.load(
                weight_ptr + row_off[:, None] + cols[None, :],
                mask=((pos + chunk)[:, None] < n) & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_WEIGHTS:
                w = tl.load(id_weights_ptr + at, mask=live, other=0.0)
                rows = rows * w[:, None]
            acc += tl.sum(rows, axis=0)
            pos += CHUNK
        if HAS_MEAN:
            acc = acc / tl.where(is_mean, n, 1).to(tl.float32)
        row = (tl.program_id(0) * SCAN_BAGS + k).to(tl.int64)
        tl.store(
            out_ptr + row * stride_ob + j * stride_of + cols,
            acc.to(out_ptr.dtype.element_ty),
            mask=col_mask,
        )
        pending = tl.where(pick, 0, pending)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Launch parameters of the forward.

    Attributes:
        block_bags: Bags per tile program (a power of two).
        num_warps: Warps per tile program.
        unroll: Bag positions loaded per loop iteration of a tile.
        long_threshold: Bags with more ids go to the long-bag launch.
    """

    block_bags: int
    num_warps: int
    unroll: int
    long_threshold: int


# Tuned configs by (D, length bucket, dtype name): a tuning run fills it; absent keys
# take forward_config's defaults.
FORWARD_TABLE: dict[tuple[int, int, str], ForwardConfig] = {}

_TILE_ELEMENTS = 4096  # float32 sum per tile: 32 registers a thread at 4 warps
_IN_FLIGHT_ELEMENTS = 8192  # rows loaded per iteration (block_bags * unroll * D)
_LONG_MIN = 64  # smallest long-bag threshold
_SCAN_BAGS = 128  # bags whose lengths one long-bag program scans
_LONG_TILE = 4096  # CHUNK * BLOCK_D of the long-bag kernel


def length_bucket(mean_len: float) -> int:
    """Mean bag length rounded up to a power of two, in 1 .. 32 (the config key)."""
    return min(triton.next_power_of_2(max(1, math.ceil(mean_len))), 32)


def forward_config(
    dim: int, mean_len: float, dtype: torch.dtype, device: torch.device | str | None = None
) -> ForwardConfig:
    """The forward's launch parameters for rows of ``dim`` columns in ``dtype`` and bags of
    ``mean_len`` ids on average: :data:`FORWARD_TABLE`'s entry, else the per-device tuning
    table's entry for ``device`` (:mod:`~recaccel.ops.embedding.triton.tuning`), else defaults.

    Defaults: a ``[block_bags, next_pow2(D)]`` sum of at most 4096 floats (8 to 128
    bags), ``unroll`` 1 for one-id bags and up to 4 for longer ones within 8192 rows'
    elements in flight, 4 warps (2 for small tiles), and a long threshold of 8 times
    the length bucket, at least 64, so that a tile loops at most that long.
    """
    bucket = length_bucket(mean_len)
    tuned = FORWARD_TABLE.get((dim, bucket, str(dtype).removeprefix("torch.")))
    if tuned is not None:
        return tuned
    if device is not None:
        key = tuning.forward_key(dim, bucket, dtype)
        entry = tuning.lookup(device, key)
        if entry is not None:
            fields = tuple(f.name for f in dataclasses.fields(ForwardConfig))
            check_entry(entry, fields, name=f"embedding tuning table: forward entry {key!r}")
            return ForwardConfig(**entry)
    block_d = triton.next_power_of_2(dim)
    block_bags = max(8, min(128, _TILE_ELEMENTS // block_d))
    unroll = min(bucket, 4)
    while unroll > 1 and unroll * block_bags * block_d > _IN_FLIGHT_ELEMENTS:
        unroll //= 2
    num_warps = 4 if block_bags * block_d >= 2048 else 2
    return ForwardConfig(block_bags, num_warps, unroll, max(_LONG_MIN, 8 * bucket))


def _pow2_divisor(values: list[int], cap: int) -> int:
    """The largest power of two up to ``cap`` dividing every value."""
    vec = cap
    while vec > 1 and any(v % vec for v in values):
        vec //= 2
    return vec


def check_forward_launchable(device: torch.device) -> None:
    """Raises :class:`~recaccel.ops.backend.BackendUnavailableError` when the forward
    cannot run on tensors of ``device`` (CPU tensors, kernels compiled, not interpreted)."""
    check_triton_launchable(_bag_tile_kernel, device, "PackedEmbeddingBag")


def _check_out(out: Tensor, shape: tuple[int, int, int], device: torch.device) -> None:
    """Raises RecaccelError naming what is wrong with a caller's ``out`` tensor."""
    if tuple(out.shape) != shape:
        raise RecaccelError(f"embedding forward: out has shape {tuple(out.shape)}, expected {shape}")
    if out.dtype not in _OUT_DTYPES:
        raise RecaccelError(
            f"embedding forward: out has dtype {out.dtype}, expected float32, bfloat16 or float16"
        )
    if out.device != device:
        raise RecaccelError(f"embedding forward: out is on {out.device} but the rows are on {device}")
    if out.numel() and out.stride(2) != 1:
        raise RecaccelError(f"embedding forward: out's last dim has stride {out.stride(2)}, expected 1")


def autocast_out_dtype(device: torch.device) -> torch.dtype:
    """The pooled output's dtype for a consumer on ``device``: the autocast dtype when
    autocast is on there (halves the pooled write and its gradient), else float32."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


def _launch(
    weight: Tensor,
    sf: SparseFeatures,
    local: LocalFeatures,
    batch_size: int,
    row_lo: int,
    out: Tensor,
    config: ForwardConfig,
) -> None:
    """Runs the tile launch, then the long-bag launch when a bag can be long."""
    num_rows, dim = out.shape[0], weight.shape[1]
    has_weights = sf.weights is not None
    # The deferred bounds check: the routing carries the tables' sizes, the batch its counter.
    bad_ids = getattr(sf, "bad_ids", None)
    check = local.limit is not None and bad_ids is not None
    block_d = triton.next_power_of_2(dim)
    cap = 16 // weight.element_size()  # elements in 16 bytes
    args = (
        weight,
        sf.values,
        sf.offsets,
        sf.weights if has_weights else weight,
        local.src,
        local.row_offset,
        local.is_mean,
        local.limit if check else local.row_offset,
        bad_ids if check else local.row_offset,
        out,
        batch_size,
        row_lo,
        num_rows,
        config.long_threshold,
        weight.stride(0),
        out.stride(0),
        out.stride(1),
    )
    common = {"DIM": dim, "HAS_WEIGHTS": has_weights, "HAS_MEAN": local.any_mean, "CHECK": check}
    w_vec = _pow2_divisor([weight.stride(0)], cap)
    _bag_tile_kernel[(triton.cdiv(num_rows, config.block_bags), local.count)](
        *args,
        **common,
        BLOCK_BAGS=config.block_bags,
        BLOCK_D=block_d,
        UNROLL=config.unroll,
        W_VEC=w_vec,
        O_VEC=_pow2_divisor([out.stride(0), out.stride(1)], 16 // out.element_size()),
        num_warps=config.num_warps,
    )
    one_id_bags = sf.one_hot and config.long_threshold >= 1
    if one_id_bags or sf.values.numel() <= config.long_threshold:
        return  # no bag can be long (one id a bag, or fewer ids than a long bag holds)
    long_d = min(block_d, 128)
    _long_bag_kernel[(triton.cdiv(num_rows, _SCAN_BAGS), local.count, triton.cdiv(dim, long_d))](
        *args,
        **common,
        SCAN_BAGS=_SCAN_BAGS,
        CHUNK=max(8, min(64, _LONG_TILE // long_d)),
        BLOCK_D=long_d,
        W_VEC=w_vec,
        num_warps=4,
    )


def embedding_bag_forward(
    weight: Tensor,
    sf: SparseFeatures,
    local: LocalFeatures,
    batch_size: int,
    *,
    out: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: ForwardConfig | None = None,
) -> Tensor:
    """Pools every local feature of one pack: one tile launch, plus one for long bags.

    Args:
        weight: [R, D] packed rows with unit column stride: float32, bfloat16 or
            float16 (pooled in float32).
        sf: The batch (int32 or int64 ids and offsets); ``sf.weights`` float32 or None.
        local: The pack's S features (``src = -1`` pools to zeros).
        batch_size: B.
        out: Where to write, e.g. a strided view into an interaction's [B, F+1, D]
            input: [B, S, D], float32, bfloat16 or float16, unit column stride.
        out_dtype: The dtype of the output made when ``out`` is None (float32, or the
            autocast dtype: :func:`autocast_out_dtype`).
        config: Launch parameters (default :func:`forward_config`).

    Returns:
        ``out``, or a new [B, S, D] tensor of ``out_dtype``.

    Raises:
        RecaccelError: ``out`` of the wrong shape, dtype, device or column stride.
    """
    return embedding_bag_forward_rows(
        weight, sf, local, batch_size, 0, batch_size, out=out, out_dtype=out_dtype, config=config
    )


def embedding_bag_forward_rows(
    weight: Tensor,
    sf: SparseFeatures,
    local: LocalFeatures,
    batch_size: int,
    lo: int,
    hi: int,
    *,
    out: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: ForwardConfig | None = None,
) -> Tensor:
    """Pools batch rows ``lo .. hi-1`` of every local feature of one pack.

    The tiles cover those rows only; each bag is pooled exactly as
    :func:`embedding_bag_forward` pools it (the config is keyed by the whole batch's
    mean bag length), so the result is those rows of its result, bit for bit.

    Args:
        weight: [R, D] packed rows (see :func:`embedding_bag_forward`).
        sf: The batch.
        local: The pack's S features.
        batch_size: B.
        lo: First row, ``0 <= lo <= hi <= B``.
        hi: One past the last row.
        out: [hi-lo, S, D] to write into (see :func:`embedding_bag_forward`).
        out_dtype: The dtype of the output made when ``out`` is None.
        config: Launch parameters (default :func:`forward_config`).

    Returns:
        ``out``, or a new [hi-lo, S, D] tensor of ``out_dtype``.
    """
    dim = weight.shape[1]
    shape = (hi - lo, local.count, dim)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=weight.device)
    else:
        _check_out(out, shape, weight.device)
    if out.numel() == 0:
        return out
    if config is None:
        mean_len = sf.values.numel() / max(1, sf.offsets.numel() - 1)
        config = forward_config(dim, mean_len, weight.dtype, weight.device)
    _launch(weight, sf, local, batch_size, lo, out, config)
    return out
