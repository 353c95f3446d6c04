"""Triton packed embedding bag: forward, backward and fused sparse-optimizer kernels.

Kernels (each with its launcher below it; the autograd Functions are in
:mod:`recaccel.ops.embedding.triton.autograd`; the reference is
:mod:`recaccel.ops.embedding.reference`):

- The forward (bag tiles) is in :mod:`recaccel.ops.embedding.triton.forward`.
- Backward, both modes: the pack's ids are sorted by packed row on the device
  (``torch.sort`` + ``unique_consecutive``), giving each unique row a contiguous
  segment of occurrences, so every row is owned by one program and no atomics are needed.
- ``_embedding_bag_bwd_kernel`` (autograd mode): grid ``(U, cdiv(D, BLOCK_D))``, sums
  each unique row's occurrence gradients into a compact [U, D] tensor.
- ``_embedding_bag_fused_update_kernel`` (fused mode): grid ``(U,)``, one program per
  unique row with the whole row in registers: sums its gradient, then applies SGD,
  row-wise Adagrad (which needs the full row for its mean of squares) or Adam to the
  row and its state in the same pass.

They run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
this module is imported).

Shapes: B batch, S features of the pack, D dim, R packed rows, N_p ids, U unique rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel.ops.embedding.optimizers import PackState, adam_bias_corrections
from recaccel.ops.embedding.packing import PackIds, RowGroups, group_by_row
from recaccel.ops.embedding.specs import SparseOptimConfig
from recaccel.ops.embedding.triton.forward import check_forward_launchable

_OPTIMIZER_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
_BLOCK_L = 16  # ids (or occurrences) loaded per loop iteration


def check_kernels_launchable(device: torch.device) -> None:
    """Raises :class:`~recaccel.ops.backend.BackendUnavailableError` when these kernels
    cannot run on tensors of ``device`` (CPU tensors, kernels compiled, not interpreted)."""
    check_forward_launchable(device)


def _block_d(dim: int) -> int:
    """Columns per program of the autograd-backward kernel."""
    return min(triton.next_power_of_2(dim), 128)


@triton.jit
def _row_grad_sum(
    grad_out_ptr,
    bags_ptr,
    scale_ptr,
    seg_start,
    seg_end,
    batch_size,
    stride_gb,
    stride_gf,
    stride_gd,
    cols,
    col_mask,
    HAS_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Sums ``scale * grad_out[bag]`` over the occurrences ``seg_start .. seg_end-1`` of a row."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = seg_start
    while first < seg_end:
        pos = first + tl.arange(0, BLOCK_L)
        pos_mask = pos < seg_end
        first += BLOCK_L
        bag = tl.load(bags_ptr + pos, mask=pos_mask, other=0)
        j = bag // batch_size
        b = bag % batch_size
        g = tl.load(
            grad_out_ptr + b[:, None] * stride_gb + j[:, None] * stride_gf + cols[None, :] * stride_gd,
            mask=pos_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if HAS_SCALE:
            s = tl.load(scale_ptr + pos, mask=pos_mask, other=0.0)
            g = g * s[:, None]
        acc += tl.sum(g, axis=0)
    return acc


@triton.jit
def _embedding_bag_bwd_kernel(
    grad_out_ptr,  # float32 [B, S, D], any strides
    bags_ptr,  # int64 [N_p] bag of each occurrence, sorted by row
    scale_ptr,  # float32 [N_p] (read only if HAS_SCALE)
    seg_ptr,  # int64 [U+1] occurrence segment of each unique row
    out_ptr,  # float32 [U, D]
    batch_size,
    dim,
    stride_gb,
    stride_gf,
    stride_gd,
    HAS_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    acc = _row_grad_sum(
        grad_out_ptr, bags_ptr, scale_ptr, tl.load(seg_ptr + u), tl.load(seg_ptr + u + 1),
        batch_size, stride_gb, stride_gf, stride_gd, cols, col_mask, HAS_SCALE, BLOCK_L, BLOCK_D,
    )  # fmt: skip
    tl.store(out_ptr + u * dim + cols, acc, mask=col_mask)


@triton.jit
def _uniform_noise(seed, index):
    """Uniform float32 in [0, 1): :func:`recaccel.ops.embedding.rounding.uniform_noise`, bit for bit."""
    h = (index & 0xFFFFFFFF) ^ seed
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2^-24


@triton.jit
def _stochastic_round(x, noise, dtype: tl.constexpr):
    """Rounds float32 ``x`` to the 16-bit ``dtype``: to the neighbour further from zero with
    probability (|x| - lo) / (hi - lo), as :func:`recaccel.ops.embedding.rounding.stochastic_round`."""
    nearest = x.to(dtype)
    near = nearest.to(tl.float32)
    up = tl.abs(x) > tl.abs(near)
    step = tl.where(up, 1, -1).to(tl.int16)
    other = (nearest.to(tl.int16, bitcast=True) + step).to(dtype, bitcast=True)
    far = other.to(tl.float32)
    lo = tl.where(up, near, far)
    hi = tl.where(up, far, near)
    pick_hi = noise < (x - lo) / (hi - lo)
    rounded = tl.where(pick_hi == up, other, nearest)
    return tl.where((near == x) | (x != x), nearest, rounded)


@triton.jit(do_not_specialize=["seed"])  # a new seed every update: no recompiles
def _embedding_bag_fused_update_kernel(
    weight_ptr,  # float32, bfloat16 or float16 [R, D], updated in place
    m1_ptr,  # float32 [R] (row-wise Adagrad) or [R, D] (Adam)
    m2_ptr,  # float32 [R, D] (Adam)
    rows_ptr,  # int64 [U] unique packed rows
    grad_out_ptr,
    bags_ptr,
    scale_ptr,
    seg_ptr,
    batch_size,
    dim,
    stride_w,
    stride_gb,
    stride_gf,
    stride_gd,
    lr,
    eps,
    beta1,
    beta2,
    weight_decay,
    bias_c1,
    bias_c2,
    seed,  # this update's stochastic-rounding seed (16-bit rows)
    OPTIMIZER: tl.constexpr,  # 0 sgd, 1 row-wise adagrad, 2 adam
    STOCHASTIC: tl.constexpr,  # 16-bit rows: write back with stochastic rounding
    HAS_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + u)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    g = _row_grad_sum(
        grad_out_ptr, bags_ptr, scale_ptr, tl.load(seg_ptr + u), tl.load(seg_ptr + u + 1),
        batch_size, stride_gb, stride_gf, stride_gd, cols, col_mask, HAS_SCALE, BLOCK_L, BLOCK_D,
    )  # fmt: skip
    w_ptrs = weight_ptr + row * stride_w + cols
    w = tl.load(w_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    if OPTIMIZER == 0:
        w = w - lr * (g + weight_decay * w)
    elif OPTIMIZER == 1:
        g = g + weight_decay * w
        m = tl.load(m1_ptr + row) + tl.sum(g * g, axis=0) / dim
        tl.store(m1_ptr + row, m)
        w = w - (lr / (tl.sqrt_rn(m) + eps)) * g
    else:
        state = row * dim + cols
        m1 = beta1 * tl.load(m1_ptr + state, mask=col_mask, other=0.0) + (1.0 - beta1) * g
        m2 = beta2 * tl.load(m2_ptr + state, mask=col_mask, other=0.0) + (1.0 - beta2) * g * g
        tl.store(m1_ptr + state, m1, mask=col_mask)
        tl.store(m2_ptr + state, m2, mask=col_mask)
        w = w - lr * ((m1 / bias_c1) / (tl.sqrt_rn(m2 / bias_c2) + eps) + weight_decay * w)
    if STOCHASTIC:
        noise = _uniform_noise(seed, row * dim + cols)
        tl.store(w_ptrs, _stochastic_round(w, noise, weight_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(w_ptrs, w, mask=col_mask)


def sort_by_row(
    ids: PackIds, groups: RowGroups | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Groups a pack's occurrences by packed row (the dedup step, on the device).

    Args:
        ids: The pack's ids, with ``bags``.
        groups: ``group_by_row(ids.rows)`` when already made (a prepared batch).

    Returns:
        (unique_rows int64 [U], segments int64 [U+1] so that the occurrences of
        ``unique_rows[u]`` are ``segments[u] .. segments[u+1]-1`` of the sorted order,
        bags int64 [N_p] and scale float32 [N_p] or None, both in sorted order).
    """
    perm, unique_rows, segments = group_by_row(ids.rows) if groups is None else groups
    scale = None if ids.scale is None else ids.scale[perm]
    return unique_rows, segments, ids.bags[perm], scale


def embedding_bag_backward(
    grad_out: Tensor, ids: PackIds, batch_size: int, groups: RowGroups | None = None
) -> tuple[Tensor, Tensor]:
    """Per-unique-row weight gradient of one pack (autograd mode).

    Args:
        grad_out: [B, S, D] gradient of the pooled output.
        ids: The pack's ids, with ``bags``.
        batch_size: B.
        groups: The ids' row grouping when already made (see :func:`sort_by_row`).

    Returns:
        (rows int64 [U] sorted unique packed rows, grad float32 [U, D]).
    """
    dim = grad_out.shape[2]
    rows, segments, bags, scale = sort_by_row(ids, groups)
    grad = torch.empty(rows.numel(), dim, dtype=torch.float32, device=grad_out.device)
    if rows.numel() == 0:
        return rows, grad
    grad_out = grad_out.to(torch.float32)
    block_d = _block_d(dim)
    _embedding_bag_bwd_kernel[(rows.numel(), triton.cdiv(dim, block_d))](
        grad_out,
        bags,
        segments if scale is None else scale,
        segments,
        grad,
        batch_size,
        dim,
        grad_out.stride(0),
        grad_out.stride(1),
        grad_out.stride(2),
        HAS_SCALE=scale is not None,
        BLOCK_L=_BLOCK_L,
        BLOCK_D=block_d,
    )
    return rows, grad


def fused_update(
    state: PackState,
    optim: SparseOptimConfig,
    grad_out: Tensor,
    ids: PackIds,
    batch_size: int,
    groups: RowGroups | None = None,
) -> None:
    """Deduplicates a pack's rows and applies the sparse optimizer to them in one launch.

    16-bit rows are upcast, updated in float32 and stored back with stochastic rounding
    (the seed drawn from ``state.rounding_seed``); the optimizer state is float32.

    Args:
        state: The pack's weight, optimizer state and step, updated in place.
        optim: Hyper-parameters.
        grad_out: [B, S, D] gradient of the pooled output.
        ids: The pack's ids, with ``bags``.
        batch_size: B.
        groups: The ids' row grouping when already made (see :func:`sort_by_row`).
    """
    state.step.add_(1)
    seed = 0 if state.rounding_seed is None else state.rounding_seed()
    rows, segments, bags, scale = sort_by_row(ids, groups)
    if rows.numel() == 0:
        return
    dim = state.weight.shape[1]
    grad_out = grad_out.to(torch.float32)
    bc1, bc2 = adam_bias_corrections(optim, int(state.step))
    m1 = state.states.get("momentum1", state.weight)
    m2 = state.states.get("momentum2", state.weight)
    _embedding_bag_fused_update_kernel[(rows.numel(),)](
        state.weight,
        m1,
        m2,
        rows,
        grad_out,
        bags,
        segments if scale is None else scale,
        segments,
        batch_size,
        dim,
        state.weight.stride(0),
        grad_out.stride(0),
        grad_out.stride(1),
        grad_out.stride(2),
        optim.lr,
        optim.eps,
        optim.beta1,
        optim.beta2,
        optim.weight_decay,
        bc1,
        bc2,
        seed,
        OPTIMIZER=_OPTIMIZER_CODES[state.optimizer],
        STOCHASTIC=state.weight.dtype in (torch.bfloat16, torch.float16),
        HAS_SCALE=scale is not None,
        BLOCK_L=_BLOCK_L,
        BLOCK_D=triton.next_power_of_2(dim),
    )
