"""DCN-v2 low-rank cross network in plain PyTorch: the specification, and the checks both backends share.

L cross layers over ``x0`` [B, K]::

    h_l     = x_l V_l^T                 [B, r]
    y_l     = h_l U_l^T + b_l           [B, K]
    x_{l+1} = x0 * y_l + x_l            [B, K]

with the layer weights stacked: ``u`` [L, K, r], ``v`` [L, r, K], ``b`` [L, K]. The
output is ``x_L``. Shapes: B batch, K features (D + F*D in a DLRM), r rank, L layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The dtypes the triton backend takes (here, so the dispatch reads it without importing Triton).
CROSS_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What the triton backend runs: library GEMMs + one fused elementwise kernel per layer (the
# default: GEMM-bound work belongs to cuBLAS), or every layer in one fused launch.
CROSS_KERNELS = ("gemm", "fused")


def check_cross_input(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> None:
    """Raises ValueError unless ``x0`` [B, K], ``u`` [L, K, r], ``v`` [L, r, K], ``b`` [L, K]
    agree, are floating point of one dtype and on one device, with K, r, L >= 1."""
    if x0.dim() != 2 or u.dim() != 3 or v.dim() != 3 or b.dim() != 2:
        raise ValueError(
            f"dcnv2_cross expects x0 [B, K], u [L, K, r], v [L, r, K], b [L, K]; got shapes "
            f"{tuple(x0.shape)}, {tuple(u.shape)}, {tuple(v.shape)}, {tuple(b.shape)}"
        )
    num_layers, k, rank = u.shape
    if x0.shape[1] != k or tuple(v.shape) != (num_layers, rank, k) or tuple(b.shape) != (num_layers, k):
        raise ValueError(
            f"dcnv2_cross: shapes disagree: x0 {tuple(x0.shape)}, u {tuple(u.shape)} [L, K, r], "
            f"v {tuple(v.shape)} [L, r, K], b {tuple(b.shape)} [L, K]"
        )
    if min(num_layers, k, rank) < 1:
        raise ValueError(f"dcnv2_cross needs L, K, r >= 1, got L={num_layers}, K={k}, r={rank}")
    if not x0.is_floating_point() or len({x0.dtype, u.dtype, v.dtype, b.dtype}) != 1:
        raise ValueError(
            f"dcnv2_cross expects floating-point tensors of one dtype, got "
            f"{x0.dtype}, {u.dtype}, {v.dtype}, {b.dtype}"
        )
    if len({x0.device, u.device, v.device, b.device}) != 1:
        raise ValueError("dcnv2_cross expects all tensors on one device")


def dcnv2_cross_reference(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> Tensor:
    """The cross network in plain PyTorch (the specification; differentiable to any order).

    Args:
        x0: [B, K].
        u: [L, K, r].
        v: [L, r, K].
        b: [L, K].

    Returns:
        x_L [B, K] in ``x0``'s dtype.
    """
    check_cross_input(x0, u, v, b)
    x = x0
    for layer in range(u.shape[0]):
        y = torch.addmm(b[layer], x @ v[layer].t(), u[layer].t())
        x = x0 * y + x
    return x


def dcnv2_cross_backward_reference(
    grad_out: Tensor, x0: Tensor, u: Tensor, v: Tensor, b: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`dcnv2_cross_reference` w.r.t. ``x0``, ``u``, ``v``, ``b``, written out.

    With g_{l+1} the gradient of x_{l+1}, going down the layers::

        dy_l  = g_{l+1} * x0            dh_l = dy_l U_l
        dU_l  = dy_l^T h_l              dV_l = dh_l^T x_l          db_l = sum over rows of dy_l
        g_l   = g_{l+1} + dh_l V_l      dx0 += g_{l+1} * y_l

    and ``dx0 = g_0 + sum_l g_{l+1} * y_l``: the specification of the Triton backward.

    Args:
        grad_out: [B, K].
        x0, u, v, b: as in :func:`dcnv2_cross_reference`.

    Returns:
        (grad_x0 [B, K], grad_u [L, K, r], grad_v [L, r, K], grad_b [L, K]).
    """
    xs, hs, ys = [x0], [], []
    for layer in range(u.shape[0]):
        hs.append(xs[-1] @ v[layer].t())
        ys.append(hs[-1] @ u[layer].t() + b[layer])
        xs.append(x0 * ys[-1] + xs[-1])
    g = grad_out
    grad_x0 = torch.zeros_like(x0)
    grad_u, grad_v, grad_b = torch.zeros_like(u), torch.zeros_like(v), torch.zeros_like(b)
    for layer in reversed(range(u.shape[0])):
        dy = g * x0
        dh = dy @ u[layer]
        grad_u[layer] = dy.t() @ hs[layer]
        grad_v[layer] = dh.t() @ xs[layer]
        grad_b[layer] = dy.sum(0)
        grad_x0 = grad_x0 + g * ys[layer]
        g = g + dh @ v[layer]
    return grad_x0 + g, grad_u, grad_v, grad_b


def init_cross_weights(
    in_features: int, num_layers: int, rank: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh ``(u, v, b)``: Glorot-normal U and V (as the DCN-v2 paper), zero biases.

    Args:
        in_features: K.
        num_layers: L.
        rank: r.
        generator: optional RNG for reproducible weights.

    Returns:
        u [L, K, r], v [L, r, K], b [L, K], float32.
    """
    std = (2.0 / (in_features + rank)) ** 0.5
    u = torch.randn(num_layers, in_features, rank, generator=generator) * std
    v = torch.randn(num_layers, rank, in_features, generator=generator) * std
    return u, v, torch.zeros(num_layers, in_features)
