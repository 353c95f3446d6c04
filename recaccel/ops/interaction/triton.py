"""Fused Triton kernels for the DLRM dot interaction (see :mod:`recaccel.ops.interaction`).

Forward: one program per (batch row, tile pair of rows) computes a tile of the Gram
matrix ``x x^T`` with ``tl.dot`` (float32 accumulation) and writes only its strict
upper triangle; the first program of a batch row also copies the dense row. Rows are
padded to a power-of-two tile of at least 16 (``tl.dot``'s minimum) with masked loads.

Backward: ``grad_x = (G + G^T) x`` plus the dense gradient on row 0, where G holds
the pair gradients in the strict upper triangle. Each program gathers a tile of the
symmetric ``G + G^T`` straight from ``grad_out`` (pair (i, j) and (j, i) read the same
column), so G is never materialised.

Both kernels are ``torch.library`` custom ops (``recaccel::dot_interaction`` and
``recaccel::dot_interaction_backward``) with fake (meta) and vmap rules, tied together
by ``torch.autograd.Function``s that also work under ``torch.func`` (grad, vmap). The
backward's own gradient is written in PyTorch, so second-order autograd (MAML) works.

R, D and the tile count are compile-time constants: a model has one shape, so this
costs one compilation, folds the index arithmetic, and keeps loop bounds static (which
Triton's interpreter also needs with NumPy 2).

Whether kernels are interpreted is fixed when this module is imported: set
``TRITON_INTERPRET=1`` before then to run them on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel.ops.backend import check_triton_launchable
from recaccel.ops.interaction.reference import (
    TRITON_DTYPES,
    check_interaction_input,
    pair_indices,
    symmetric_from_pairs,
)

_OP = "dot_interaction"


@triton.jit
def _dot_interaction_fwd_kernel(
    x_ptr,
    out_ptr,
    R: tl.constexpr,
    D: tl.constexpr,
    stride_xb,
    stride_xr,
    stride_xd,
    stride_ob,
    BT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ti = tl.program_id(1)
    tj = tl.program_id(2)
    if ti > tj:  # tiles below the diagonal hold no pair i < j
        return
    offs = tl.arange(0, BT)
    ri = ti * BT + offs
    rj = tj * BT + offs
    cols = tl.arange(0, BLOCK_D)
    x_row = x_ptr + b * stride_xb
    out_row = out_ptr + b * stride_ob
    copy_dense = (ti == 0) & (tj == 0)
    acc = tl.zeros((BT, BT), dtype=tl.float32)
    for k in range(0, D, BLOCK_D):
        d = k + cols
        dm = d < D
        xi = tl.load(
            x_row + ri[:, None] * stride_xr + d[None, :] * stride_xd,
            mask=(ri < R)[:, None] & dm[None, :],
            other=0.0,
        )
        xj = tl.load(
            x_row + rj[:, None] * stride_xr + d[None, :] * stride_xd,
            mask=(rj < R)[:, None] & dm[None, :],
            other=0.0,
        )
        # float32 operands: exact for bf16/fp16 inputs even at tf32 precision.
        acc = tl.dot(xi.to(tl.float32), tl.trans(xj.to(tl.float32)), acc, input_precision=PRECISION)
        dense = tl.load(x_row + d * stride_xd, mask=dm & copy_dense, other=0.0)
        tl.store(out_row + d, dense, mask=dm & copy_dense)
    i = ri[:, None]
    j = rj[None, :]
    col = D + i * R - (i * (i + 1)) // 2 + (j - i - 1)
    tl.store(out_row + col, acc.to(out_ptr.dtype.element_ty), mask=(i < j) & (j < R))


@triton.jit
def _dot_interaction_bwd_kernel(
    grad_ptr,
    x_ptr,
    gx_ptr,
    R: tl.constexpr,
    D: tl.constexpr,
    N_TILES: tl.constexpr,
    stride_gb,
    stride_gc,
    stride_xb,
    stride_xr,
    stride_xd,
    stride_gxb,
    stride_gxr,
    BT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ti = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    offs = tl.arange(0, BT)
    ri = ti * BT + offs
    grad_row = grad_ptr + b * stride_gb
    x_row = x_ptr + b * stride_xb
    acc = tl.zeros((BT, BLOCK_D), dtype=tl.float32)
    for tj in range(N_TILES):
        rj = tj * BT + offs
        i = ri[:, None]
        j = rj[None, :]
        lo = tl.minimum(i, j)
        hi = tl.maximum(i, j)
        col = D + lo * R - (lo * (lo + 1)) // 2 + (hi - lo - 1)
        sym = tl.load(grad_row + col * stride_gc, mask=(i != j) & (i < R) & (j < R), other=0.0)
        xj = tl.load(
            x_row + rj[:, None] * stride_xr + d[None, :] * stride_xd,
            mask=(rj < R)[:, None] & dm[None, :],
            other=0.0,
        )
        acc = tl.dot(sym.to(tl.float32), xj.to(tl.float32), acc, input_precision=PRECISION)
    g_dense = tl.load(grad_row + d * stride_gc, mask=dm & (ti == 0), other=0.0).to(tl.float32)
    acc += tl.where((ri == 0)[:, None], g_dense[None, :], 0.0)
    tl.store(
        gx_ptr + b * stride_gxb + ri[:, None] * stride_gxr + d[None, :],
        acc.to(gx_ptr.dtype.element_ty),
        mask=(ri < R)[:, None] & dm[None, :],
    )


def _launch_config(num_rows: int, dim: int) -> tuple[int, int, int, int]:
    """(row tile BT, number of row tiles, BLOCK_D, num_warps) for R rows of dim D.

    Tiles hold at most 4096 float32 elements per operand so registers do not spill.
    """
    bt = min(64, max(16, triton.next_power_of_2(num_rows)))
    n_tiles = triton.cdiv(num_rows, bt)
    block_d = max(16, min(triton.next_power_of_2(dim), 128, 4096 // bt))
    num_warps = 4 if bt * max(bt, block_d) <= 4096 else 8
    return bt, n_tiles, block_d, num_warps


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: tf32 is exact for half inputs; float32 follows torch's TF32 flag."""
    if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _check_dtype(x: Tensor) -> None:
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"{_OP}: the triton backend supports {TRITON_DTYPES}, got {x.dtype}")


def _forward(x: Tensor) -> Tensor:
    check_triton_launchable(_dot_interaction_fwd_kernel, x.device, _OP)
    b, r, d = x.shape
    out = torch.empty(b, d + r * (r - 1) // 2, dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    bt, n_tiles, block_d, num_warps = _launch_config(r, d)
    _dot_interaction_fwd_kernel[(b, n_tiles, n_tiles)](
        x, out, r, d, x.stride(0), x.stride(1), x.stride(2), out.stride(0),
        BT=bt, BLOCK_D=block_d, PRECISION=_precision(x.dtype), num_warps=num_warps,
    )  # fmt: skip
    return out


def _backward(grad_out: Tensor, x: Tensor) -> Tensor:
    check_triton_launchable(_dot_interaction_bwd_kernel, x.device, _OP)
    b, r, d = x.shape
    grad_x = torch.empty(b, r, d, dtype=x.dtype, device=x.device)
    if b == 0:
        return grad_x
    bt, n_tiles, block_d, num_warps = _launch_config(r, d)
    grid = (b, n_tiles, triton.cdiv(d, block_d))
    _dot_interaction_bwd_kernel[grid](
        grad_out, x, grad_x, r, d, n_tiles, grad_out.stride(0), grad_out.stride(1),
        x.stride(0), x.stride(1), x.stride(2), grad_x.stride(0), grad_x.stride(1),
        BT=bt, BLOCK_D=block_d, PRECISION=_precision(x.dtype), num_warps=num_warps,
    )  # fmt: skip
    return grad_x


@torch.library.custom_op("recaccel::dot_interaction", mutates_args=())
def _dot_interaction_op(x: Tensor) -> Tensor:
    return _forward(x)


@_dot_interaction_op.register_fake
def _dot_interaction_fake(x: Tensor) -> Tensor:
    b, r, d = x.shape
    return x.new_empty(b, d + r * (r - 1) // 2)


@torch.library.custom_op("recaccel::dot_interaction_backward", mutates_args=())
def _dot_interaction_backward_op(grad_out: Tensor, x: Tensor) -> Tensor:
    return _backward(grad_out, x)


@_dot_interaction_backward_op.register_fake
def _dot_interaction_backward_fake(grad_out: Tensor, x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fold_vmap_dim(t: Tensor, dim: int | None, size: int) -> Tensor:
    """[..vmapped at dim..] -> [V*B, ...]: vmapped rows are just more batch rows."""
    t = t.unsqueeze(0).expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(size * t.shape[1], *t.shape[2:])


@_dot_interaction_op.register_vmap
def _dot_interaction_vmap(info, in_dims, x: Tensor):
    (dim,) = in_dims
    if dim is None:
        return _dot_interaction_op(x), None
    out = _dot_interaction_op(_fold_vmap_dim(x, dim, info.batch_size))
    return out.reshape(info.batch_size, -1, out.shape[1]), 0


@_dot_interaction_backward_op.register_vmap
def _dot_interaction_backward_vmap(info, in_dims, grad_out: Tensor, x: Tensor):
    g_dim, x_dim = in_dims
    if g_dim is None and x_dim is None:
        return _dot_interaction_backward_op(grad_out, x), None
    v = info.batch_size
    out = _dot_interaction_backward_op(_fold_vmap_dim(grad_out, g_dim, v), _fold_vmap_dim(x, x_dim, v))
    return out.reshape(v, -1, *out.shape[1:]), 0


class _DotInteractionFn(torch.autograd.Function):
    """Autograd over the forward op; works under torch.func transforms (grad, vmap)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return _dot_interaction_op(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return _DotInteractionBackwardFn.apply(grad_out, x)


class _DotInteractionBackwardFn(torch.autograd.Function):
    """The backward kernel as a differentiable function, for second-order autograd."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_out: Tensor, x: Tensor) -> Tensor:
        return _dot_interaction_backward_op(grad_out, x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_grad_x: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients of ``grad_x = (G + G^T) x + dense`` w.r.t. grad_out and x, in PyTorch."""
        grad_out, x = ctx.saved_tensors
        d, r = x.shape[2], x.shape[1]
        iu, ju = pair_indices(r, x.device)
        cross = torch.bmm(grad_grad_x, x.transpose(1, 2))
        pair_grad = (cross + cross.transpose(1, 2))[:, iu, ju]
        grad_grad_out = torch.cat([grad_grad_x[:, 0], pair_grad], dim=1).to(grad_out.dtype)
        grad_x = torch.bmm(symmetric_from_pairs(grad_out[:, d:].to(x.dtype), r), grad_grad_x)
        return grad_grad_out, grad_x


def dot_interaction_triton(x: Tensor) -> Tensor:
    """Triton dot interaction with autograd; same contract as ``dot_interaction_reference``.

    Args:
        x: [B, F+1, D] float32, bfloat16 or float16 on CUDA (or CPU under the interpreter).

    Returns:
        [B, D + (F+1)F/2] in ``x``'s dtype.
    """
    check_interaction_input(x)
    _check_dtype(x)
    return _DotInteractionFn.apply(x)
