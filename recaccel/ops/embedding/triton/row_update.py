"""The row update of the occurrence-tile backward (:mod:`~recaccel.ops.embedding.triton.backward`):
the sparse optimizer's rules on a block of rows, and the kernel that finishes the rows
whose occurrences span several tile programs from the programs' head / tail partials.

``_spanning_rows_kernel``'s "tile" is one tile program's span of sorted occurrences
(``BLOCK_OCC`` here is the tile kernel's ``BLOCK_OCC x SUBTILES``).
"""

import triton
import triton.language as tl

from recaccel.ops.embedding.triton.rounding import _stochastic_round, _uniform_noise

PARTIAL_VALUES = 8192  # float32 partial values one fix-up step loads (4 warps: 64 a thread)
FIXUP_WARPS = 4


def partials_per_step(block_d: int) -> int:
    """Partials a fix-up kernel (the tiles' spanning rows, the lanes' combine) loads and
    sums per step: a hot row's partials are walked in steps of this many, one dependent
    load chain each, so its fix-up takes ~partials / this steps (16 to 128; sm_90, 4 warps:
    56-72 registers, no spills, at D 32-256)."""
    return min(128, max(16, PARTIAL_VALUES // block_d))


@triton.jit
def _load_rows(weight_ptr, key, live, cols, col_mask, stride_w, MODE: tl.constexpr):
    """Rows ``key`` of the weight as float32 [M, BLOCK_D] (0 where not ``live``, and all 0
    in MODE 3, the gradient store, which reads none): what :func:`_update_rows` updates,
    loadable ahead of the gradient's sum."""
    key = key.to(tl.int64)
    mask = live[:, None] & col_mask[None, :] & (MODE != 3)
    return tl.load(weight_ptr + key[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _update_rows(
    weight_ptr,
    m1_ptr,
    m2_ptr,
    key,  # int32 or int64 [M] destination row of each gradient row
    g,  # float32 [M, BLOCK_D] summed gradient (0 in padded columns)
    w,  # float32 [M, BLOCK_D] the rows as loaded (_load_rows); unused in MODE 3
    live,  # bool [M] rows to update
    cols,
    col_mask,
    dim,
    stride_w,
    lr,
    eps,
    beta1,
    beta2,
    one_minus_beta1,  # 1 - beta, rounded once from float64 on the host (as the reference)
    one_minus_beta2,
    weight_decay,
    bias_c1,
    bias_c2,
    seed,
    MODE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Applies the sparse optimizer (or stores the gradient) to ``M`` loaded rows at once:
    the rules of the reference optimizer, :func:`~recaccel.ops.embedding.optimizers.update_rows`'s semantics."""
    key = key.to(tl.int64)  # int32 keys (int32 ids): row * D and the rounding hash need int64
    mask = live[:, None] & col_mask[None, :]
    w_ptrs = weight_ptr + key[:, None] * stride_w + cols[None, :]
    if MODE == 3:
        tl.store(w_ptrs, g, mask=mask)
    else:
        if MODE == 0:
            w = w - lr * (g + weight_decay * w)
        elif MODE == 1:
            g = g + weight_decay * w
            m = tl.load(m1_ptr + key, mask=live, other=0.0) + tl.sum(g * g, axis=1) / dim
            tl.store(m1_ptr + key, m, mask=live)
            w = w - (lr / (tl.sqrt_rn(m) + eps))[:, None] * g
        else:
            state = key[:, None] * dim + cols[None, :]
            m1 = beta1 * tl.load(m1_ptr + state, mask=mask, other=0.0) + one_minus_beta1 * g
            m2 = beta2 * tl.load(m2_ptr + state, mask=mask, other=0.0) + one_minus_beta2 * g * g
            tl.store(m1_ptr + state, m1, mask=mask)
            tl.store(m2_ptr + state, m2, mask=mask)
            w = w - lr * ((m1 / bias_c1) / (tl.sqrt_rn(m2 / bias_c2) + eps) + weight_decay * w)
        if STOCHASTIC:
            noise = _uniform_noise(seed, key[:, None] * dim + cols[None, :])
            tl.store(w_ptrs, _stochastic_round(w, noise, weight_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(w_ptrs, w, mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _spanning_rows_kernel(
    weight_ptr,
    m1_ptr,
    m2_ptr,
    keys_ptr,
    part_ptr,
    num_occ,
    num_tiles,
    dim,
    stride_w,
    lr_ptr,  # float32 [1] the learning rate (a device scalar: a captured step replays its updates)
    eps,
    beta1,
    beta2,
    one_minus_beta1,  # 1 - beta, rounded once from float64 on the host (as the reference)
    one_minus_beta2,
    weight_decay,
    bias_c1,
    bias_c2,
    seed,
    MODE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_OCC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
):
    lr = tl.load(lr_ptr)
    t = tl.program_id(0).to(tl.int64)
    start = t * BLOCK_OCC
    last = tl.minimum(start + BLOCK_OCC, num_occ) - 1
    key = tl.load(keys_ptr + last)
    before = tl.load(keys_ptr + start - 1, mask=start > 0, other=-1)
    nxt = tl.load(keys_ptr + last + 1, mask=last + 1 < num_occ, other=-1)
    # Tile t owns the segment of its last occurrence iff it began here and goes on.
    owns = (nxt == key) & (key != before)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    acc = tl.load(part_ptr + t * (2 * BLOCK_D) + BLOCK_D + cols, mask=owns, other=0.0)
    # Tiles after t that the segment covers whole (its "middle") are a prefix of the
    # following tiles; the first tile that is not a middle one is where it ends.
    k = t + 1
    middles = tl.where(owns, CHUNK, 0)
    while middles == CHUNK:
        ks = k + tl.arange(0, CHUNK)
        in_range = ks < num_tiles
        ks_last = tl.minimum((ks + 1) * BLOCK_OCC, num_occ) - 1
        last_key = tl.load(keys_ptr + ks_last, mask=in_range, other=-1)
        next_key = tl.load(keys_ptr + ks_last + 1, mask=in_range & (ks_last + 1 < num_occ), other=-1)
        middle = in_range & (last_key == key) & (next_key == key)
        tails = tl.load(
            part_ptr + ks[:, None] * (2 * BLOCK_D) + BLOCK_D + cols[None, :], mask=middle[:, None], other=0.0
        )
        acc += tl.sum(tails, axis=0)
        middles = tl.sum(middle.to(tl.int32), axis=0)
        k += CHUNK
    closing = k - CHUNK + middles
    acc += tl.load(part_ptr + closing * (2 * BLOCK_D) + cols, mask=owns, other=0.0)
    one = tl.zeros([1], dtype=tl.int64)
    rows, live = key + one, owns & (one == 0)
    w = _load_rows(weight_ptr, rows, live, cols, col_mask, stride_w, MODE)
    _update_rows(
        weight_ptr, m1_ptr, m2_ptr, rows, acc[None, :], w, live, cols, col_mask, dim, stride_w,
        lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay, bias_c1, bias_c2, seed, MODE, STOCHASTIC,
    )  # fmt: skip
