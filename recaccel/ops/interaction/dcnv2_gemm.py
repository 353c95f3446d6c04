"""DCN-v2 cross network at GEMM speed: library GEMMs plus one fused elementwise kernel per layer.

The cross network is matmul work (at MLPerf's shape 348 GFLOP forward), so each layer's two
matmuls go to the library (cuBLAS on CUDA), and only the elementwise part is a kernel of ours::

    h_l     = x_l V_l^T                  torch.mm
    y_l     = b_l + h_l U_l^T            torch.addmm (bias added in the GEMM epilogue)
    x_{l+1} = x0 * y_l + x_l             _cross_fwd_ew_kernel (one read of each, one write)

The backward goes down the layers with g = dL/dx_{l+1}::

    dy_l = g * x0,  acc += g * y_l       _cross_bwd_ew_kernel (acc in float32),
    db_l = sum dy_l                      and column sums of dy per row strip, summed after
    dU_l = dy_l^T h_l,  dh_l = dy_l U_l,  dV_l = dh_l^T x_l
    g    = addmm(g, dh_l, V_l)           the skip connection's gradient added by the GEMM

and at layer 0 the kernel writes ``g + acc + g * y_0`` in the input dtype, so
``dx0 = addmm(that, dh_0, V_0)`` needs no extra pass. Where eager PyTorch runs a multiply and
an add per layer forward and three elementwise passes per layer backward (plus autograd's
gradient sums), this runs one.

Elementwise bytes per layer, with E = B*K*element size (113 MB at MLPerf's B=16384, K=3456
in bfloat16; the float32 acc is 2E there), before and after the bias gradient moved into the
backward kernel and layer 0's forward read x0 once:

=====================  ===========================================  ==========================
pass                   before                                       after
=====================  ===========================================  ==========================
forward, layer 0       read x0, y, x (= x0), write x_1: 4E           read x0, y, write x_1: 3E
forward, layer > 0     read x0, y, x_l, write x_{l+1}: 4E            4E (x_L is the output)
backward, top layer    read g, x0, y, write dy, acc (2E), then       6E + E/16
                       ``dy.sum(0)`` reads dy again: 7E
backward, middle       as the top + read acc (2E): 9E                8E + E/16
backward, layer 0      read g, x0, y, acc, write dy, out (E), then   7E + E/16
                       ``dy.sum(0)``: 8E
=====================  ===========================================  ==========================

E/16 is the float32 column-sum buffer (one row per :data:`_BWD_ROWS` rows of the batch),
written and read once (E/32 in float32). Three layers in bfloat16: backward 24E -> about
21.2E, ~2.8E = ~320 MB less DRAM traffic, ~75 us at 4.3 TB/s of the H200's measured 3.08 ms
forward + backward. The forward's 12E -> 11E counts loads issued: layer 0's second read of
the same x0 addresses mostly hit the cache before, so its DRAM bytes barely change. What was
already minimal: the top layer reads no acc, layer 0 writes its sum in the input dtype (not
float32), and the last forward layer writes only x_L, the output. About 32E (~0.85 ms)
of elementwise traffic remains; the rest of the step is the GEMMs.

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
_BWD_TILE = 2048  # elements per backward tile: BLOCK_R rows x BLOCK_K contiguous columns
_BWD_MAX_COLS = 128  # columns per tile: 256 contiguous bytes of a row in bfloat16
_BWD_ROW_TILES = 4  # tiles down the rows per program, so the column-sum buffer stays small
_BWD_ROWS = _BWD_TILE // _BWD_MAX_COLS * _BWD_ROW_TILES  # batch rows per column-sum row (K >= 128)


@triton.jit
def _cross_fwd_ew_kernel(x0_ptr, y_ptr, x_ptr, out_ptr, n, X_IS_X0: tl.constexpr, BLOCK: tl.constexpr):
    """out = x0 * y + x over ``n`` contiguous elements, in float32, rounded once; where
    X_IS_X0 (layer 0) ``x`` is ``x0`` and is read once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if X_IS_X0:
        x = x0
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x0 * y + x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_bwd_ew_kernel(
    g_ptr, x0_ptr, y_ptr, acc_ptr, dy_ptr, out_ptr, colsum_ptr, rows, cols,
    HAS_ACC: tl.constexpr, FINAL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr,
):  # fmt: skip
    """dy = g * x0 and out = acc + g * y (+ g where FINAL: the layer-0 pass) over a strip of
    BLOCK_R * ROW_TILES rows by BLOCK_K columns of the [rows, cols] tensors; the strip's column
    sums of the stored (rounded) dy go to row ``program_id(0)`` of ``colsum`` [*, cols] float32.

    ``acc`` and ``out`` are float32 except the FINAL ``out``, which is the input dtype (the
    addend of the last addmm)."""
    cols_at = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols_at < cols
    colsum = tl.zeros([BLOCK_K], dtype=tl.float32)
    for t in range(ROW_TILES):
        rows_at = (tl.program_id(0) * ROW_TILES + t) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows_at < rows)[:, None] & col_ok[None, :]
        offs = rows_at.to(tl.int64)[:, None] * cols + cols_at[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = (g * x0).to(dy_ptr.dtype.element_ty)
        tl.store(dy_ptr + offs, dy, mask=mask)
        colsum += tl.sum(dy.to(tl.float32), axis=0)  # masked lanes hold 0
        acc = g * y
        if HAS_ACC:
            acc += tl.load(acc_ptr + offs, mask=mask, other=0.0)
        if FINAL:
            acc += g
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(colsum_ptr + tl.program_id(0).to(tl.int64) * cols + cols_at, colsum, mask=col_ok)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _bwd_tile(cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) of the backward tile: up to 128 contiguous columns, rows to fill it."""
    block_k = min(_BWD_MAX_COLS, triton.next_power_of_2(max(cols, 1)))
    return _BWD_TILE // block_k, block_k


def cross_elementwise(x0: Tensor, y: Tensor, x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x0 * y + x`` in one pass (float32 arithmetic, one rounding).

    Args:
        x0, y, x: contiguous, of one shape and dtype (``x`` may be ``x0`` itself: read once).
        out: where to write (contiguous, that shape); a new tensor if None.
    """
    out = torch.empty_like(x) if out is None else out
    if x.numel() > 0:
        _cross_fwd_ew_kernel[_grid(x.numel())](
            x0, y, x, out, x.numel(), X_IS_X0=x is x0, BLOCK=_BLOCK, num_warps=_WARPS
        )
    return out


def cross_backward_pass(
    g: Tensor, x0: Tensor, y: Tensor, acc: Tensor | None, *, final: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(g * x0, acc + g * y [+ g if final], column sums of g * x0)`` in one pass over
    contiguous [B, K] inputs of one shape.

    Returns:
        dy in ``g``'s dtype; the sum, float32 or ``g``'s dtype when ``final``; and db [K]
        float32, the sum over rows of the stored dy (per row strip in the kernel, then the
        strips in a fixed order: deterministic).
    """
    rows, cols = g.shape
    dy = torch.empty_like(g)
    out = torch.empty_like(g) if final else torch.empty_like(g, dtype=torch.float32)
    if g.numel() == 0:
        return dy, out, torch.zeros(cols, dtype=torch.float32, device=g.device)
    block_r, block_k = _bwd_tile(cols)
    strips = triton.cdiv(rows, block_r * _BWD_ROW_TILES)
    colsum = torch.empty(strips, cols, dtype=torch.float32, device=g.device)
    _cross_bwd_ew_kernel[(strips, triton.cdiv(cols, block_k))](
        g, x0, y, acc if acc is not None else g, dy, out, colsum, rows, cols,
        HAS_ACC=acc is not None, FINAL=final,
        BLOCK_R=block_r, BLOCK_K=block_k, ROW_TILES=_BWD_ROW_TILES, num_warps=_WARPS,
    )  # fmt: skip
    return dy, out, colsum.sum(0)


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
            dy, acc, grad_b[layer] = cross_backward_pass(g, x0, ys[layer], acc, final=layer == 0)
            torch.mm(dy.t(), hs[layer], out=grad_u[layer])
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
