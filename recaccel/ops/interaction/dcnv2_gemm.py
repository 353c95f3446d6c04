"""DCN-v2 cross network at GEMM speed: library GEMMs plus one fused elementwise kernel per layer.

The cross network is matmul work (at MLPerf's shape 348 GFLOP forward), so each layer's two
matmuls go to the library (cuBLAS on CUDA), and only the elementwise part is a kernel of ours::

    h_l     = x_l V_l^T                  torch.mm
    y_l     = b_l + h_l U_l^T            torch.addmm (bias added in the GEMM epilogue)
    x_{l+1} = x0 * y_l + x_l             _cross_fwd_ew_kernel (one read of each, one write)

The backward goes down the layers with g = dL/dx_{l+1}::

    dy_l = g * x0,  acc += g * y_l       _cross_bwd_ew_kernel (acc in float32)
    dU_l = dy_l^T h_l,  db_l = sum dy_l,  dh_l = dy_l U_l,  dV_l = dh_l^T x_l
    g    = addmm(g, dh_l, V_l)           the skip connection's gradient added by the GEMM

and at layer 0 the kernel writes ``g + acc + g * y_0``, so ``dx0 = addmm(that, dh_0, V_0)``
needs no extra pass. Where eager PyTorch runs a multiply and an add per layer forward and
three elementwise passes per layer backward (plus autograd's gradient sums), this runs one.

Both directions are ``torch.library`` custom ops with fake rules, joined by a
``torch.autograd.Function``; a backward that is itself differentiated (second order) is
taken through the reference. The elementwise kernels run on CUDA, or on CPU tensors under
``TRITON_INTERPRET=1`` (set before this module is imported).

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

_OP = "dcnv2_cross (gemm)"
_BLOCK = 2048  # elements per program: 16-byte vector loads, enough bytes in flight per SM
_WARPS = 8


@triton.jit
def _cross_fwd_ew_kernel(x0_ptr, y_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x0 * y + x over ``n`` contiguous elements, in float32, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x0 * y + x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_bwd_ew_kernel(
    g_ptr, x0_ptr, y_ptr, acc_ptr, dy_ptr, out_ptr, n,
    HAS_ACC: tl.constexpr, FINAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dy = g * x0 and out = acc + g * y (+ g where FINAL: the layer-0 pass) over ``n`` elements.

    ``acc`` and ``out`` are float32 except the FINAL ``out``, which is the input dtype (the
    addend of the last addmm)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dy_ptr + offs, (g * x0).to(dy_ptr.dtype.element_ty), mask=mask)
    acc = g * y
    if HAS_ACC:
        acc += tl.load(acc_ptr + offs, mask=mask, other=0.0)
    if FINAL:
        acc += g
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def cross_elementwise(x0: Tensor, y: Tensor, x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x0 * y + x`` in one pass (float32 arithmetic, one rounding).

    Args:
        x0, y, x: contiguous, of one shape and dtype.
        out: where to write (contiguous, that shape); a new tensor if None.
    """
    out = torch.empty_like(x) if out is None else out
    if x.numel() > 0:
        _cross_fwd_ew_kernel[_grid(x.numel())](x0, y, x, out, x.numel(), BLOCK=_BLOCK, num_warps=_WARPS)
    return out


def cross_elementwise_backward(
    g: Tensor, x0: Tensor, y: Tensor, acc: Tensor | None, *, final: bool
) -> tuple[Tensor, Tensor]:
    """``(g * x0, acc + g * y [+ g if final])`` in one pass; contiguous inputs of one shape.

    Returns:
        dy in ``g``'s dtype, and the sum: float32, or ``g``'s dtype when ``final``.
    """
    dy = torch.empty_like(g)
    out = torch.empty_like(g) if final else torch.empty_like(g, dtype=torch.float32)
    if g.numel() > 0:
        _cross_bwd_ew_kernel[_grid(g.numel())](
            g, x0, y, acc if acc is not None else g, dy, out, g.numel(),
            HAS_ACC=acc is not None, FINAL=final, BLOCK=_BLOCK, num_warps=_WARPS,
        )  # fmt: skip
    return dy, out


def _forward(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x_L, and what the backward needs: x_1..x_{L-1} [L-1, B, K], h [L, B, r], y [L, B, K]."""
    check_triton_launchable(_cross_fwd_ew_kernel, x0.device, _OP)
    x0 = x0.contiguous()
    layers, k, rank = u.shape
    xs = x0.new_empty(layers - 1, x0.shape[0], k)
    hs = x0.new_empty(layers, x0.shape[0], rank)
    ys = x0.new_empty(layers, x0.shape[0], k)
    x = x0
    # Every operand is already in one dtype; autocast must not re-cast into the out= buffers.
    with torch.autocast(x0.device.type, enabled=False):
        for layer in range(layers):
            torch.mm(x, v[layer].t(), out=hs[layer])
            torch.addmm(b[layer], hs[layer], u[layer].t(), out=ys[layer])
            x = cross_elementwise(x0, ys[layer], x, xs[layer] if layer < layers - 1 else None)
    return x, xs, hs, ys


def _backward(
    grad_out: Tensor, x0: Tensor, u: Tensor, v: Tensor, xs: Tensor, hs: Tensor, ys: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients w.r.t. x0, u, v, b (see the module docstring for the recurrence)."""
    check_triton_launchable(_cross_bwd_ew_kernel, x0.device, _OP)
    g, x0 = grad_out.contiguous(), x0.contiguous()
    layers = u.shape[0]
    grad_u, grad_v = torch.empty_like(u), torch.empty_like(v)
    grad_b = u.new_empty(layers, u.shape[1])
    acc = None
    with torch.autocast(x0.device.type, enabled=False):
        for layer in reversed(range(layers)):
            dy, acc = cross_elementwise_backward(g, x0, ys[layer], acc, final=layer == 0)
            torch.mm(dy.t(), hs[layer], out=grad_u[layer])
            grad_b[layer] = dy.sum(0, dtype=torch.float32)
            dh = dy @ u[layer]
            torch.mm(dh.t(), xs[layer - 1] if layer > 0 else x0, out=grad_v[layer])
            # g_layer = g + dh V; at layer 0 the addend already holds g + every g_{l+1} * y_l.
            g = torch.addmm(acc if layer == 0 else g, dh, v[layer])
    return g, grad_u, grad_v, grad_b


_CrossFn = cross_function(
    *register_cross_ops("dcnv2_cross_gemm", _forward, _backward, layer_major=True), "GEMM-path"
)


def dcnv2_cross_gemm(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> Tensor:
    """Cross network by library GEMMs and one fused elementwise kernel per layer, with autograd;
    same contract as ``dcnv2_cross_reference``.

    Args:
        x0: [B, K] float32, bfloat16 or float16 on CUDA (or CPU under the interpreter).
        u: [L, K, r], v: [L, r, K], b: [L, K], in ``x0``'s dtype.

    Returns:
        x_L [B, K] in ``x0``'s dtype. The GEMMs follow torch's matmul settings (TF32 for
        float32 where torch's TF32 switch is on); elementwise work in float32.

    Raises:
        ValueError: bad shapes, or a dtype the kernels do not take.
    """
    check_cross_input(x0, u, v, b)
    if x0.dtype not in CROSS_TRITON_DTYPES:
        raise ValueError(f"{_OP}: supports {CROSS_TRITON_DTYPES}, got {x0.dtype}")
    return _CrossFn.apply(x0, u, v, b)[0]
