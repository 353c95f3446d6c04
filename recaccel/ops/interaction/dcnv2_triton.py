"""Fused Triton kernels for the DCN-v2 cross network (see :mod:`recaccel.ops.interaction.dcnv2_reference`).

Forward: one launch for all L layers. Each program owns a block of BM rows and runs
every layer for them, streaming the weights: ``h = x_l V^T`` (tiles of r, reduced over
K with ``tl.dot``), then per tile of K ``y = h U^T + b`` and ``x_{l+1} = x0 * y + x_l``
in the epilogue, so ``y`` and the products never make an extra round trip through
memory as they do in eager (a matmul, an addmm, a multiply and an add per layer). A
program re-reads what it wrote itself (``h``, ``x_{l+1}``) after a block barrier;
those rows are its own, so no other program is waited on. ``x_1..x_{L-1}``, ``h`` and
``y`` are kept for the backward.

Backward: one launch walks the layers down for each row block (``dy = g x0``,
``dh = dy U``, ``g <- g + dh V``, ``dx0 += g y``), with the running gradient in a
float32 scratch that alternates between two slots so no tile is read and written in
one phase. The weight gradients are sums over all rows (``dU = dy^T h``,
``dV = dh^T x_l``, ``db = sum dy``): batched library matmuls over the saved ``dy``
and ``dh``.

Both are ``torch.library`` custom ops with fake (meta) rules, joined by a
``torch.autograd.Function``; a backward that must itself be differentiated (MAML's
second order) is taken through the reference instead.

Whether kernels are interpreted is fixed when this module is imported: set
``TRITON_INTERPRET=1`` before then to run them on CPU tensors.

Shapes: B batch, K features, r rank, L layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel.ops.backend import check_triton_launchable
from recaccel.ops.interaction.dcnv2_autograd import cross_function, register_cross_ops
from recaccel.ops.interaction.dcnv2_reference import (
    CROSS_TRITON_DTYPES,
    check_cross_input,
)
from recaccel.ops.tf32 import tf32_enabled

_OP = "dcnv2_cross"


@triton.jit
def _mm_rows(a_ptr, a_row, w_ptr, w_stride_out, w_stride_in, n0, B_OUT: tl.constexpr,
             N_OUT: tl.constexpr, N_IN: tl.constexpr, BM: tl.constexpr, BIN: tl.constexpr,
             rmask, DT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """[BM, B_OUT] tile of ``A W^T``: A's rows at ``a_ptr + a_row + i`` (i < N_IN),
    W[o, i] at ``w_ptr + o * w_stride_out + i * w_stride_in``, outputs n0 .. n0+B_OUT.
    Operands multiply in DT (the input dtype, or float32 where it is not exact), sums in float32."""
    offs_o = n0 + tl.arange(0, B_OUT)
    om = offs_o < N_OUT
    acc = tl.zeros((BM, B_OUT), dtype=tl.float32)
    for i0 in range(0, N_IN, BIN):
        offs_i = i0 + tl.arange(0, BIN)
        im = offs_i < N_IN
        a = tl.load(a_ptr + a_row[:, None] + offs_i[None, :], mask=rmask[:, None] & im[None, :], other=0.0)
        w = tl.load(
            w_ptr + offs_o[None, :] * w_stride_out + offs_i[:, None] * w_stride_in,
            mask=im[:, None] & om[None, :],
            other=0.0,
        )
        acc = tl.dot(a.to(DT), w.to(DT), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _cross_fwd_kernel(
    x0_ptr, u_ptr, v_ptr, b_ptr, out_ptr, xs_ptr, hs_ptr, ys_ptr, B,
    K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < B
    r64 = rows.to(tl.int64)
    DT = x0_ptr.dtype.element_ty
    MM_DT = tl.float32 if UPCAST else DT
    row_k = r64 * K  # x0, out: [B, K]
    for layer in tl.static_range(L):
        # Where x_layer is read from and x_{layer+1} written to: x0 | xs [B, L-1, K] | out.
        if layer == 0:
            src_ptr = x0_ptr
            src_row = row_k
        else:
            src_ptr = xs_ptr
            src_row = r64 * ((L - 1) * K) + (layer - 1) * K
        if layer == L - 1:
            dst_ptr = out_ptr
            dst_row = row_k
        else:
            dst_ptr = xs_ptr
            dst_row = r64 * ((L - 1) * K) + layer * K
        h_row = r64 * (L * R) + layer * R  # hs [B, L, R]
        y_row = r64 * (L * K) + layer * K  # ys [B, L, K]
        # h = x_l V^T: V[j, k] at v + layer*R*K + j*K + k.
        for j0 in range(0, R, BR):
            h = _mm_rows(
                src_ptr, src_row, v_ptr + layer * R * K, K, 1, j0, BR, R, K, BM, BK, rmask, MM_DT, PRECISION
            )
            jj = j0 + tl.arange(0, BR)
            tl.store(hs_ptr + h_row[:, None] + jj[None, :], h.to(DT), mask=rmask[:, None] & (jj < R)[None, :])
        tl.debug_barrier()  # this program's h rows are written before they are read
        # y = h U^T + b: U[k, j] at u + layer*K*R + k*R + j; then x_{l+1} = x0 * y + x_l.
        for n0 in range(0, K, BK):
            y = _mm_rows(
                hs_ptr, h_row, u_ptr + layer * K * R, R, 1, n0, BK, K, R, BM, BR, rmask, MM_DT, PRECISION
            )
            kk = n0 + tl.arange(0, BK)
            km = kk < K
            m2 = rmask[:, None] & km[None, :]
            y += tl.load(b_ptr + layer * K + kk, mask=km, other=0.0).to(tl.float32)[None, :]
            x0 = tl.load(x0_ptr + row_k[:, None] + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            xl = tl.load(src_ptr + src_row[:, None] + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            tl.store(ys_ptr + y_row[:, None] + kk[None, :], y.to(DT), mask=m2)
            tl.store(dst_ptr + dst_row[:, None] + kk[None, :], (x0 * y + xl).to(DT), mask=m2)
        tl.debug_barrier()  # x_{l+1} is written before the next layer reads it


@triton.jit
def _cross_bwd_kernel(
    g_ptr, x0_ptr, u_ptr, v_ptr, ys_ptr, gx0_ptr, dys_ptr, dhs_ptr, gbuf_ptr, acc_ptr, B,
    K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < B
    r64 = rows.to(tl.int64)
    DT = x0_ptr.dtype.element_ty
    MM_DT = tl.float32 if UPCAST else DT
    row_k = r64 * K  # grad_out, x0, gx0, acc: [B, K]
    for step in tl.static_range(L):
        layer = L - 1 - step
        # g_{layer+1}: grad_out for the top layer, else slot (step % 2) of gbuf [B, 2, K] (float32).
        if step == 0:
            gin_ptr = g_ptr
            gin_row = row_k
        else:
            gin_ptr = gbuf_ptr
            gin_row = r64 * (2 * K) + (step % 2) * K
        gout_row = r64 * (2 * K) + ((step + 1) % 2) * K
        y_row = r64 * (L * K) + layer * K  # ys, dys [B, L, K]
        h_row = r64 * (L * R) + layer * R  # dhs [B, L, R]
        # dy = g x0 (kept for dU, db and dh); dx0 accumulates g y in float32.
        for n0 in range(0, K, BK):
            kk = n0 + tl.arange(0, BK)
            m2 = rmask[:, None] & (kk < K)[None, :]
            g = tl.load(gin_ptr + gin_row[:, None] + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            x0 = tl.load(x0_ptr + row_k[:, None] + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            y = tl.load(ys_ptr + y_row[:, None] + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            acc = g * y
            if step > 0:
                acc += tl.load(acc_ptr + row_k[:, None] + kk[None, :], mask=m2, other=0.0)
            tl.store(acc_ptr + row_k[:, None] + kk[None, :], acc, mask=m2)
            tl.store(dys_ptr + y_row[:, None] + kk[None, :], (g * x0).to(DT), mask=m2)
        tl.debug_barrier()
        # dh = dy U: U[k, j] at u + layer*K*R + k*R + j, read as W[j, k] (stride 1 over j, R over k).
        for j0 in range(0, R, BR):
            dh = _mm_rows(
                dys_ptr, y_row, u_ptr + layer * K * R, 1, R, j0, BR, R, K, BM, BK, rmask, MM_DT, PRECISION
            )
            jj = j0 + tl.arange(0, BR)
            tl.store(
                dhs_ptr + h_row[:, None] + jj[None, :], dh.to(DT), mask=rmask[:, None] & (jj < R)[None, :]
            )
        tl.debug_barrier()
        # g_layer = g_{layer+1} + dh V: V[j, k] at v + layer*R*K + j*K + k, read as W[k, j].
        for n0 in range(0, K, BK):
            gv = _mm_rows(
                dhs_ptr, h_row, v_ptr + layer * R * K, 1, K, n0, BK, K, R, BM, BR, rmask, MM_DT, PRECISION
            )
            kk = n0 + tl.arange(0, BK)
            m2 = rmask[:, None] & (kk < K)[None, :]
            g = tl.load(gin_ptr + gin_row[:, None] + kk[None, :], mask=m2, other=0.0).to(tl.float32) + gv
            if layer == 0:  # dx0 = g_0 + sum of g y
                acc = tl.load(acc_ptr + row_k[:, None] + kk[None, :], mask=m2, other=0.0)
                tl.store(gx0_ptr + row_k[:, None] + kk[None, :], (acc + g).to(DT), mask=m2)
            else:
                tl.store(gbuf_ptr + gout_row[:, None] + kk[None, :], g, mask=m2)
        tl.debug_barrier()


def _launch_config(k: int, rank: int) -> tuple[int, int, int, int]:
    """(BM rows, BK, BR, num_warps): tiles of at least 16 (``tl.dot``'s minimum), at most
    64 rows by 64 columns so an operand tile stays 4096 elements."""
    bk = max(16, min(64, triton.next_power_of_2(k)))
    br = max(16, min(64, triton.next_power_of_2(rank)))
    return 64, bk, br, 4


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: half inputs multiply exactly; float32 follows torch's TF32 flag."""
    if dtype != torch.float32 or tf32_enabled():
        return "tf32"
    return "ieee"


def _upcast(x0: Tensor) -> bool:
    """Multiply bfloat16 operands as float32: Triton 3.6's interpreter gets bfloat16
    ``tl.dot`` wrong (CPU only; CUDA multiplies bfloat16 natively)."""
    return x0.dtype == torch.bfloat16 and x0.device.type != "cuda"


def _forward(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_triton_launchable(_cross_fwd_kernel, x0.device, _OP)
    x0, u, v, b = x0.contiguous(), u.contiguous(), v.contiguous(), b.contiguous()
    rows, k = x0.shape
    layers, _, rank = u.shape
    out = torch.empty_like(x0)
    xs = x0.new_empty(rows, layers - 1, k)
    hs = x0.new_empty(rows, layers, rank)
    ys = x0.new_empty(rows, layers, k)
    if rows == 0:
        return out, xs, hs, ys
    bm, bk, br, num_warps = _launch_config(k, rank)
    _cross_fwd_kernel[(triton.cdiv(rows, bm),)](
        x0, u, v, b, out, xs, hs, ys, rows, k, rank, layers,
        BM=bm, BK=bk, BR=br, PRECISION=_precision(x0.dtype), UPCAST=_upcast(x0),
        num_warps=num_warps,
    )  # fmt: skip
    return out, xs, hs, ys


def _backward(
    grad_out: Tensor, x0: Tensor, u: Tensor, v: Tensor, xs: Tensor, hs: Tensor, ys: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_triton_launchable(_cross_bwd_kernel, x0.device, _OP)
    grad_out, x0, u, v = grad_out.contiguous(), x0.contiguous(), u.contiguous(), v.contiguous()
    rows, k = x0.shape
    layers, _, rank = u.shape
    grad_x0 = torch.empty_like(x0)
    dys = x0.new_empty(rows, layers, k)
    dhs = x0.new_empty(rows, layers, rank)
    if rows > 0:
        gbuf = torch.empty(rows, 2, k, dtype=torch.float32, device=x0.device)
        acc = torch.empty(rows, k, dtype=torch.float32, device=x0.device)
        bm, bk, br, num_warps = _launch_config(k, rank)
        _cross_bwd_kernel[(triton.cdiv(rows, bm),)](
            grad_out, x0, u, v, ys, grad_x0, dys, dhs, gbuf, acc, rows, k, rank, layers,
            BM=bm, BK=bk, BR=br, PRECISION=_precision(x0.dtype), UPCAST=_upcast(x0),
        num_warps=num_warps,
        )  # fmt: skip
    # Sums over all rows: batched matmuls over the layer axis.
    grad_u = torch.bmm(dys.permute(1, 2, 0), hs.permute(1, 0, 2))  # [L, K, r]
    grad_v = torch.empty_like(v)
    grad_v[0] = dhs[:, 0].t() @ x0
    if layers > 1:
        grad_v[1:] = torch.bmm(dhs[:, 1:].permute(1, 2, 0), xs.permute(1, 0, 2))
    grad_b = dys.sum(0, dtype=torch.float32).to(x0.dtype)
    return grad_x0, grad_u, grad_v, grad_b


_CrossFn = cross_function(*register_cross_ops("dcnv2_cross", _forward, _backward, layer_major=False), "fused")


def dcnv2_cross_triton(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> Tensor:
    """Triton cross network with autograd; same contract as ``dcnv2_cross_reference``.

    Args:
        x0: [B, K] float32, bfloat16 or float16 on CUDA (or CPU under the interpreter).
        u: [L, K, r], v: [L, r, K], b: [L, K], in ``x0``'s dtype.

    Returns:
        x_L [B, K] in ``x0``'s dtype; products accumulate in float32.
    """
    check_cross_input(x0, u, v, b)
    if x0.dtype not in CROSS_TRITON_DTYPES:
        raise ValueError(f"{_OP}: the triton backend supports {CROSS_TRITON_DTYPES}, got {x0.dtype}")
    return _CrossFn.apply(x0, u, v, b)[0]
