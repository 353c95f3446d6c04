"""Fused Triton kernels for the DLRM dot interaction (see :mod:`recaccel.ops.interaction`).

The input is read through two pointers, ``dense`` [B, D] (row 0) and ``pooled``
[B, F, D] (rows 1..F), so the model never concatenates them first. R = F+1 rows are
cut into row tiles of BT (a power of two >= 16, ``tl.dot``'s minimum); a program owns
BLOCK_B batch rows and one pair of row tiles ``(ti, tj)`` with ``ti <= tj``:

- R <= 64 (``ONE_TILE``): one tile holds every row; the [BLOCK_B, BT, BD] tile is loaded
  once per column chunk and multiplied by its own transpose, a batched 3-D ``tl.dot``.
- R > 64: a flat grid over the nt(nt+1)/2 upper tile pairs only (pairs fastest, so the
  programs sharing a batch row run together and share its tiles in L2).

Forward: ``gram = x_i x_j^T`` accumulated in float32 over column chunks, the strict upper
triangle stored, the dense row copied by the (0, 0) program, which also zeroes the
padding columns when the output row is padded to a multiple of 8 elements.

Backward: ``grad_x = (G + G^T) x`` plus the dense gradient on row 0, G the pair gradients
in the strict upper triangle. A program owns (row tile ti, column chunk, BLOCK_B batch
rows) and walks every tile tj: the symmetric tile comes from ``grad_out`` row-major (pair
columns are contiguous along j) for tj >= ti, and for tj < ti as the stored upper tile
[tj, ti], loaded row-major and transposed in registers; nothing is gathered along the
strided direction. Each program writes its own rows: no atomics, deterministic.

``tl.dot`` input precision follows :func:`dot_precision`: 16-bit inputs multiply natively,
float32 in "tf32" when torch allows TF32 matmuls, else "tf32x3" (float32-accurate on tensor
cores); "ieee" only under the interpreter, which also upcasts 16-bit operands (its 16-bit
``tl.dot`` is wrong in Triton 3.6).

Both kernels are ``torch.library`` custom ops (``recaccel::dot_interaction`` and
``recaccel::dot_interaction_backward``) with fake (meta) and vmap rules, tied together by
``torch.autograd.Function``s that also work under ``torch.func`` (grad, vmap). The
backward's own gradient is written in PyTorch, so second-order autograd (MAML) works.

R, D and the tile counts are compile-time constants: a model has one shape, so this costs
one compilation, folds the index arithmetic, and keeps loop bounds static (which Triton's
interpreter also needs with NumPy 2).

Whether kernels are interpreted is fixed when this module is imported: set
``TRITON_INTERPRET=1`` before then to run them on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel.ops.backend import check_triton_launchable
from recaccel.ops.interaction.launch_plan import (
    KernelConfig,
    check_config,
    dot_precision,
    launch_plan,
    tile_rows,
)
from recaccel.ops.interaction.reference import (
    TRITON_DTYPES,
    check_interaction_input,
    check_interaction_pair,
    interaction_output_dim,
    pair_indices,
    symmetric_from_pairs,
)
from recaccel.ops.tf32 import tf32_enabled

_OP = "dot_interaction"


@triton.jit
def _load_x(dense_ptr, pooled_ptr, b, bmask, rows, d, R: tl.constexpr, D: tl.constexpr,
            s_db, s_dd, s_pb, s_pr, s_pd):  # fmt: skip
    """(x [BLOCK_B, BT, BD], dense [BLOCK_B, BD]): rows ``rows`` of x = [dense; pooled] at
    columns ``d`` for batch rows ``b``; out-of-range rows, columns and batch rows read 0."""
    dm = d < D
    b3 = b[:, None, None]
    r3 = rows[None, :, None]
    d3 = d[None, None, :]
    pooled_off = b3 * s_pb + (tl.maximum(r3, 1) - 1) * s_pr + d3 * s_pd
    pmask = bmask[:, None, None] & (r3 >= 1) & (r3 < R) & dm[None, None, :]
    x = tl.load(pooled_ptr + pooled_off, mask=pmask, other=0.0)
    has_dense = tl.min(rows, axis=0) == 0
    dmask = bmask[:, None] & dm[None, :] & has_dense
    dense = tl.load(dense_ptr + b[:, None] * s_db + d[None, :] * s_dd, mask=dmask, other=0.0)
    return tl.where(r3 == 0, dense[:, None, :], x), dense


@triton.jit
def _tile_pair(p, NT: tl.constexpr):
    """(ti, tj), ti <= tj, of the p-th upper tile pair in row-major order."""
    ti = p * 0
    start = 0
    for t in tl.static_range(NT - 1):
        start += NT - t
        ti += (p >= start).to(tl.int32)
    return ti, p - (ti * NT - (ti * (ti - 1)) // 2) + ti


@triton.jit
def _dot_interaction_fwd_kernel(
    dense_ptr, pooled_ptr, out_ptr, B,
    s_db, s_dd, s_pb, s_pr, s_pd, s_ob,
    R: tl.constexpr, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    NT: tl.constexpr, BT: tl.constexpr, BLOCK_B: tl.constexpr, BD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    npairs: tl.constexpr = NT * (NT + 1) // 2
    ti, tj = _tile_pair(pid % npairs, NT)
    b = (pid // npairs).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = b < B
    ri = ti * BT + tl.arange(0, BT)
    rj = tj * BT + tl.arange(0, BT)
    first = (ti == 0) & (tj == 0)
    acc = tl.zeros((BLOCK_B, BT, BT), dtype=tl.float32)
    for k in range(0, D, BD):
        d = k + tl.arange(0, BD)
        xi, dense = _load_x(dense_ptr, pooled_ptr, b, bmask, ri, d, R, D, s_db, s_dd, s_pb, s_pr, s_pd)
        if NT == 1:
            xj = xi  # the one tile, loaded once, is both operands
        else:
            xj, _ = _load_x(dense_ptr, pooled_ptr, b, bmask, rj, d, R, D, s_db, s_dd, s_pb, s_pr, s_pd)
        if UPCAST:
            xi = xi.to(tl.float32)
            xj = xj.to(tl.float32)
        acc = tl.dot(xi, tl.trans(xj, (0, 2, 1)), acc, input_precision=PRECISION)
        tl.store(
            out_ptr + b[:, None] * s_ob + d[None, :],
            dense,
            mask=bmask[:, None] & (d < D)[None, :] & first,
        )
    i = ri[None, :, None]
    j = rj[None, None, :]
    col = D + i * R - (i * (i + 1)) // 2 + (j - i - 1)
    tl.store(
        out_ptr + b[:, None, None] * s_ob + col,
        acc.to(out_ptr.dtype.element_ty),
        mask=bmask[:, None, None] & (i < j) & (j < R),
    )
    if WP > W:  # zero padding columns W .. WP-1 (fewer than 8)
        pad = W + tl.arange(0, 8)
        zeros = tl.zeros((BLOCK_B, 8), dtype=out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + b[:, None] * s_ob + pad[None, :],
            zeros,
            mask=bmask[:, None] & (pad < WP)[None, :] & first,
        )


@triton.jit
def _sym_tile(grad_ptr, b, bmask, ri, rj, ti, tj, R: tl.constexpr, D: tl.constexpr, s_gb, s_gc):
    """[BLOCK_B, BT, BT] tile (ri, rj) of G + G^T, G the pair gradients (strict upper triangle).

    Upper tiles are read row-major; a lower tile is its mirror [tj, ti], read row-major and
    transposed in registers."""
    b3 = b[:, None, None] * s_gb
    bm = bmask[:, None, None]
    if tj > ti:
        i = ri[None, :, None]
        j = rj[None, None, :]
        col = D + i * R - (i * (i + 1)) // 2 + (j - i - 1)
        sym = tl.load(grad_ptr + b3 + col * s_gc, mask=bm & (j < R), other=0.0)
    else:
        i = rj[None, :, None]  # the mirror tile [tj, ti]: rows rj, columns ri
        j = ri[None, None, :]
        col = D + i * R - (i * (i + 1)) // 2 + (j - i - 1)
        upper = tl.load(grad_ptr + b3 + col * s_gc, mask=bm & (i < j) & (j < R), other=0.0)
        sym = tl.trans(upper, (0, 2, 1))
        if tj == ti:
            sym += upper
    return sym


@triton.jit
def _dot_interaction_bwd_kernel(
    grad_ptr, dense_ptr, pooled_ptr, gdense_ptr, gpooled_ptr, B,
    s_gb, s_gc, s_db, s_dd, s_pb, s_pr, s_pd, s_gdb, s_gpb, s_gpr,
    R: tl.constexpr, D: tl.constexpr, NT: tl.constexpr, ND: tl.constexpr,
    BT: tl.constexpr, BLOCK_B: tl.constexpr, BD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    ti = pid % NT  # row tiles fastest: a batch row's programs share its grad_out row in L2
    d = (pid // NT) % ND * BD + tl.arange(0, BD)
    b = (pid // (NT * ND)).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = b < B
    ri = ti * BT + tl.arange(0, BT)
    acc = tl.zeros((BLOCK_B, BT, BD), dtype=tl.float32)
    for tj in range(NT):
        rj = tj * BT + tl.arange(0, BT)
        sym = _sym_tile(grad_ptr, b, bmask, ri, rj, ti, tj, R, D, s_gb, s_gc)
        xj, _ = _load_x(dense_ptr, pooled_ptr, b, bmask, rj, d, R, D, s_db, s_dd, s_pb, s_pr, s_pd)
        if UPCAST:
            sym = sym.to(tl.float32)
            xj = xj.to(tl.float32)
        else:
            sym = sym.to(xj.dtype)
        acc = tl.dot(sym, xj, acc, input_precision=PRECISION)
    dm = d < D
    g_dense = tl.load(
        grad_ptr + b[:, None] * s_gb + d[None, :] * s_gc,
        mask=bmask[:, None] & dm[None, :] & (ti == 0),
        other=0.0,
    )
    r3 = ri[None, :, None]
    acc += tl.where(r3 == 0, g_dense.to(tl.float32)[:, None, :], 0.0)
    out = acc.to(gdense_ptr.dtype.element_ty)
    b3 = b[:, None, None]
    d3 = d[None, None, :]
    keep = bmask[:, None, None] & dm[None, None, :]
    tl.store(gdense_ptr + b3 * s_gdb + d3 + r3 * 0, out, mask=keep & (r3 == 0))
    tl.store(
        gpooled_ptr + b3 * s_gpb + (tl.maximum(r3, 1) - 1) * s_gpr + d3, out, mask=keep & (r3 >= 1) & (r3 < R)
    )


def _kernel_precision(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """(``tl.dot`` input_precision, upcast 16-bit operands to float32) for a launch."""
    mode = dot_precision(dtype, on_cuda=device.type == "cuda", allow_tf32=tf32_enabled())
    if mode == "native":
        return "tf32", False  # ignored by tl.dot for 16-bit operands
    return mode, mode == "ieee" and dtype != torch.float32


def _check_dtype(dense: Tensor) -> None:
    if dense.dtype not in TRITON_DTYPES:
        raise ValueError(f"{_OP}: the triton backend supports {TRITON_DTYPES}, got {dense.dtype}")


def _forward(dense: Tensor, pooled: Tensor, pad: bool) -> Tensor:
    plan = launch_plan(pooled.shape[1] + 1, dense.shape[1], dense.dtype, dense.device)
    return forward_with(dense, pooled, pad, plan.fwd)


def forward_with(dense: Tensor, pooled: Tensor, pad: bool, config: KernelConfig) -> Tensor:
    """The forward kernel launched with ``config`` (the tuning run's entry point).

    Args:
        dense: [B, D].
        pooled: [B, F, D], the same dtype.
        pad: Pad the output row to a multiple of 8 elements.
        config: The forward's launch config (:func:`check_config`).

    Returns:
        [B, D + R(R-1)/2] (padded when asked), R = F + 1.
    """
    check_triton_launchable(_dot_interaction_fwd_kernel, dense.device, _OP)
    b, d = dense.shape
    r = pooled.shape[1] + 1
    check_config(config, r)
    width = interaction_output_dim(r - 1, d)
    out = torch.empty(b, interaction_output_dim(r - 1, d, pad=pad), dtype=dense.dtype, device=dense.device)
    if b == 0:
        return out
    bt = tile_rows(config, r)
    nt = triton.cdiv(r, bt)
    precision, upcast = _kernel_precision(dense.dtype, dense.device)
    grid = (triton.cdiv(b, config.block_b) * nt * (nt + 1) // 2,)
    _dot_interaction_fwd_kernel[grid](
        dense, pooled, out, b, *dense.stride(), *pooled.stride(), out.stride(0),
        R=r, D=d, W=width, WP=out.shape[1], NT=nt, BT=bt, BLOCK_B=config.block_b,
        BD=config.bd, PRECISION=precision, UPCAST=upcast, num_warps=config.num_warps,
    )  # fmt: skip
    return out


def _backward(grad_out: Tensor, dense: Tensor, pooled: Tensor) -> tuple[Tensor, Tensor]:
    plan = launch_plan(pooled.shape[1] + 1, dense.shape[1], dense.dtype, dense.device)
    return backward_with(grad_out, dense, pooled, plan.bwd)


def backward_with(
    grad_out: Tensor, dense: Tensor, pooled: Tensor, config: KernelConfig
) -> tuple[Tensor, Tensor]:
    """The backward kernel launched with ``config``: (grad_dense [B, D], grad_pooled [B, F, D])
    for ``grad_out`` [B, W or padded W]."""
    check_triton_launchable(_dot_interaction_bwd_kernel, dense.device, _OP)
    b, d = dense.shape
    r = pooled.shape[1] + 1
    check_config(config, r)
    grad_dense = torch.empty(b, d, dtype=dense.dtype, device=dense.device)
    grad_pooled = torch.empty(b, r - 1, d, dtype=dense.dtype, device=dense.device)
    if b == 0:
        return grad_dense, grad_pooled
    bt = tile_rows(config, r)
    nt = triton.cdiv(r, bt)
    precision, upcast = _kernel_precision(dense.dtype, dense.device)
    nd = triton.cdiv(d, config.bd)
    grid = (triton.cdiv(b, config.block_b) * nt * nd,)
    _dot_interaction_bwd_kernel[grid](
        grad_out, dense, pooled, grad_dense, grad_pooled, b, *grad_out.stride(),
        *dense.stride(), *pooled.stride(), grad_dense.stride(0), *grad_pooled.stride()[:2],
        R=r, D=d, NT=nt, ND=nd, BT=bt, BLOCK_B=config.block_b, BD=config.bd,
        PRECISION=precision, UPCAST=upcast, num_warps=config.num_warps,
    )  # fmt: skip
    return grad_dense, grad_pooled


@torch.library.custom_op("recaccel::dot_interaction", mutates_args=())
def _dot_interaction_op(dense: Tensor, pooled: Tensor, pad: bool) -> Tensor:
    return _forward(dense, pooled, pad)


@_dot_interaction_op.register_fake
def _dot_interaction_fake(dense: Tensor, pooled: Tensor, pad: bool) -> Tensor:
    return dense.new_empty(dense.shape[0], interaction_output_dim(pooled.shape[1], dense.shape[1], pad=pad))


@torch.library.custom_op("recaccel::dot_interaction_backward", mutates_args=())
def _dot_interaction_backward_op(grad_out: Tensor, dense: Tensor, pooled: Tensor) -> tuple[Tensor, Tensor]:
    return _backward(grad_out, dense, pooled)


@_dot_interaction_backward_op.register_fake
def _dot_interaction_backward_fake(grad_out: Tensor, dense: Tensor, pooled: Tensor) -> tuple[Tensor, Tensor]:
    fmt = torch.contiguous_format
    return torch.empty_like(dense, memory_format=fmt), torch.empty_like(pooled, memory_format=fmt)


def _fold_vmap_dim(t: Tensor, dim: int | None, size: int) -> Tensor:
    """[..vmapped at dim..] -> [V*B, ...]: vmapped rows are just more batch rows."""
    t = t.unsqueeze(0).expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _unfold(t: Tensor, size: int) -> Tensor:
    return t.reshape(size, -1, *t.shape[1:])


@_dot_interaction_op.register_vmap
def _dot_interaction_vmap(info, in_dims, dense: Tensor, pooled: Tensor, pad: bool):
    d_dim, p_dim, _ = in_dims
    if d_dim is None and p_dim is None:
        return _dot_interaction_op(dense, pooled, pad), None
    v = info.batch_size
    out = _dot_interaction_op(_fold_vmap_dim(dense, d_dim, v), _fold_vmap_dim(pooled, p_dim, v), pad)
    return _unfold(out, v), 0


@_dot_interaction_backward_op.register_vmap
def _dot_interaction_backward_vmap(info, in_dims, grad_out: Tensor, dense: Tensor, pooled: Tensor):
    if all(dim is None for dim in in_dims):
        return _dot_interaction_backward_op(grad_out, dense, pooled), (None, None)
    v = info.batch_size
    folded = (_fold_vmap_dim(t, dim, v) for t, dim in zip((grad_out, dense, pooled), in_dims, strict=True))
    grad_dense, grad_pooled = _dot_interaction_backward_op(*folded)
    return (_unfold(grad_dense, v), _unfold(grad_pooled, v)), (0, 0)


class _DotInteractionFn(torch.autograd.Function):
    """Autograd over the forward op; works under torch.func transforms (grad, vmap)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dense: Tensor, pooled: Tensor, pad: bool) -> Tensor:
        return _dot_interaction_op(dense, pooled, pad)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:
        dense, pooled = ctx.saved_tensors
        grad_dense, grad_pooled = _DotInteractionBackwardFn.apply(grad_out, dense, pooled)
        return grad_dense, grad_pooled, None


class _DotInteractionBackwardFn(torch.autograd.Function):
    """The backward kernel as a differentiable function, for second-order autograd."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_out: Tensor, dense: Tensor, pooled: Tensor) -> tuple[Tensor, Tensor]:
        return _dot_interaction_backward_op(grad_out, dense, pooled)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, gg_dense: Tensor, gg_pooled: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of ``grad_x = (G + G^T) x + dense`` w.r.t. grad_out and x, in PyTorch."""
        grad_out, dense, pooled = ctx.saved_tensors
        x = torch.cat([dense.unsqueeze(1), pooled], dim=1)
        gg_x = torch.cat([gg_dense.unsqueeze(1), gg_pooled], dim=1)
        r, d = x.shape[1], x.shape[2]
        iu, ju = pair_indices(r, x.device)
        cross = torch.bmm(gg_x, x.transpose(1, 2))
        pair_grad = (cross + cross.transpose(1, 2))[:, iu, ju]
        padding = gg_x.new_zeros(x.shape[0], grad_out.shape[1] - d - iu.numel())
        grad_grad_out = torch.cat([gg_x[:, 0], pair_grad, padding], dim=1).to(grad_out.dtype)
        pairs = grad_out[:, d : d + iu.numel()].to(x.dtype)
        grad_x = torch.bmm(symmetric_from_pairs(pairs, r), gg_x)
        return grad_grad_out, grad_x[:, 0], grad_x[:, 1:]


def dot_interaction_pair_triton(dense: Tensor, pooled: Tensor, pad: bool = False) -> Tensor:
    """Triton dot interaction of ``dense`` [B, D] (row 0) and ``pooled`` [B, F, D] (rows 1..F).

    Same contract as ``dot_interaction_reference(cat([dense[:, None], pooled], 1), pad)``,
    without the concatenation.

    Args:
        dense: [B, D] float32, bfloat16 or float16 on CUDA (or CPU under the interpreter).
        pooled: [B, F, D], same dtype and device.
        pad: Zero-pad the output row to a multiple of 8 elements.

    Returns:
        [B, D + (F+1)F/2 (padded)] in the inputs' dtype.
    """
    check_interaction_pair(dense, pooled)
    _check_dtype(dense)
    return _DotInteractionFn.apply(dense, pooled, pad)


def dot_interaction_triton(x: Tensor, pad: bool = False) -> Tensor:
    """Triton dot interaction of stacked ``x`` [B, F+1, D]; same contract as the reference.

    Row 0 and rows 1..F are passed to the kernels as views (no copy).
    """
    check_interaction_input(x)
    return dot_interaction_pair_triton(x[:, 0], x[:, 1:], pad)
