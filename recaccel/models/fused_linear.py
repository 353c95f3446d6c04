"""MLP layers at tensor-core speed: bias + ReLU in the GEMM epilogue, aligned inner dimensions.

Two things keep a dense layer off cuBLAS(Lt)'s fastest kernels, and both are fixed here
without changing a module's parameters (state_dict keys and shapes stay those of
``nn.Linear``, so old checkpoints load and TorchRec export is unchanged):

- **Separate bias and ReLU kernels.** :func:`linear_relu` computes ``relu(x @ W^T + b)``
  with ``torch._addmm_activation`` (cuBLASLt's RELU_BIAS epilogue on CUDA: one pass
  over the output instead of three). That op has no autograd formula, so
  :class:`_LinearReLU` supplies one, written with differentiable ops so second-order
  gradients (the meta engines) still flow.
- **Unaligned inner dimensions** (the bottom MLP's 13 dense inputs, an interaction
  width of 479): row strides that are not a multiple of 16 bytes. :func:`aligned_operands`
  pads the inner dimension to a multiple of :data:`ALIGN` elements *at run time*: the
  input with zero columns (or takes an input that already arrives padded) and the
  weight with zero columns. The stored weight stays ``[out, in]``: its gradient is the
  slice of the padded one, so nothing in the optimizer ever sees a padded column, and
  the extra columns cannot drift from zero under Adam or weight decay (they do not
  exist between steps). The cost is a copy of the (small) weight and, for an input
  that arrives unpadded, of the input.

Both apply by default where they pay, CUDA (:func:`fast_path_default`); on other
devices a layer runs as ``F.linear`` + ``relu``, bit for bit as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # Triton is optional (the CPU paths never need it): without it, aten's two ops run
    from recaccel.ops.relu_bias_grad import relu_bias_grad
except ImportError:
    relu_bias_grad = None

# Inner dimensions are padded to a multiple of this many elements: 16 bytes in bf16/fp16
# (cuBLASLt's tensor-core alignment), 32 bytes in fp32.
ALIGN = 8
# Gradient dtypes whose ReLU + bias backward runs as one Triton pass on CUDA.
ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fast_path_default(x: Tensor) -> bool:
    """Whether the epilogue fusion and alignment apply to ``x`` by default: on CUDA, outside
    functorch transforms (``vmap`` has no batching rule for ``_addmm_activation``).

    ``torch.compile`` traces under an interpreter of its own, so a compiled head reads as
    outside any transform (Dynamo cannot trace the stack query itself).
    """
    if not x.is_cuda:
        return False
    if torch.compiler.is_compiling():
        return True
    return torch._C._functorch.peek_interpreter_stack() is None


def padded_width(k: int) -> int:
    """``k`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-k // ALIGN) * ALIGN


def aligned_operands(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` [..., K or Kp] and ``weight`` [N, K] with their inner dimension padded to
    Kp = :func:`padded_width` (K) by zero columns: ``x @ W^T`` is unchanged.

    An ``x`` that already has Kp columns is taken as it is (its extra columns meet zero
    weights, so their contents do not matter unless they are inf or NaN).

    Raises:
        ValueError: ``x`` has neither K nor Kp columns.
    """
    k = weight.shape[1]
    kp = padded_width(k)
    if x.shape[-1] not in (k, kp):
        raise ValueError(f"linear layer of {k} inputs got {x.shape[-1]} columns (expected {k} or {kp})")
    if kp == k:
        return x, weight
    if x.shape[-1] == k:
        x = F.pad(x, (0, kp - k))
    return x, F.pad(weight, (0, kp - k))


class _LinearReLU(torch.autograd.Function):
    """``relu(x @ W^T + b)`` in one cuBLASLt call; backward masks by the output like ``relu``'s."""

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=False)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight, out = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        # relu's own backward (threshold at the output), then addmm's three gradients.
        g, grad_b = relu_backward(grad, out)
        grad_x = g.mm(weight) if need_x else None
        # [N, K] row-major, as F.linear's backward makes it: no transposing copy when the
        # gradient is accumulated into the (row-major) weight's .grad.
        grad_w = g.t().mm(x) if need_w else None
        grad_b = (g.sum(0) if grad_b is None else grad_b) if need_b else None
        return grad_x, grad_w, grad_b


def relu_backward(grad: Tensor, out: Tensor) -> tuple[Tensor, Tensor | None]:
    """ReLU's backward in a fused layer (masked by its output ``out`` [B, N]): g [B, N], and
    the bias gradient [N] in ``out``'s dtype when the same pass made it, else None (the
    caller sums g). A first-order backward on CUDA masks and sums in one kernel
    (:func:`one_pass_relu_backward`); one that is itself differentiated (grad mode on: the
    meta engines) stays in aten's differentiable ops."""
    if one_pass_relu_backward(grad) and not torch.is_grad_enabled():
        g, grad_b = relu_bias_grad(grad, out)
        return g, grad_b.to(out.dtype)
    return torch.ops.aten.threshold_backward(grad, out, 0), None


def one_pass_relu_backward(grad: Tensor) -> bool:
    """Whether :func:`~recaccel.ops.relu_bias_grad.relu_bias_grad` takes a layer's ReLU and
    bias backward: 2-D CUDA gradients in float32 or 16 bits (its bias sums are float32, short
    of float64's; elsewhere aten's two ops)."""
    return relu_bias_grad is not None and grad.is_cuda and grad.dim() == 2 and grad.dtype in ONE_PASS_DTYPES


def linear_relu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``relu(F.linear(x, weight, bias))`` for 2-D ``x``, bias and ReLU fused into the GEMM.

    Under autocast the three operands are cast to the autocast dtype first, as autocast
    casts ``F.linear``'s (``_addmm_activation`` is not on autocast's list), and the
    result has that dtype.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return _linear_relu(x, weight, bias)
    return _linear_relu(x, weight, bias)


def _linear_relu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return _LinearReLU.apply(x, weight, bias)
    # No autograd: the op itself (torch.export and inference see a plain aten op).
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=False)


def dense_layer(
    x: Tensor, weight: Tensor, bias: Tensor | None, *, relu: bool, fused: bool, align: bool
) -> Tensor:
    """One MLP layer, ``F.linear`` (+ ``relu``), with the epilogue fusion and the inner
    alignment where asked.

    Args:
        x: [B, K] (or [B, Kp] already padded, when ``align``).
        weight: [N, K]. bias: [N] or None.
        relu: a ReLU follows the layer.
        fused: bias + ReLU in the GEMM (:func:`linear_relu`); applies to 2-D ``x`` with a
            bias and a ReLU, otherwise the layer runs unfused.
        align: pad the inner dimension to a multiple of :data:`ALIGN` (:func:`aligned_operands`).
    """
    if align:
        x, weight = aligned_operands(x, weight)
    if fused and relu and bias is not None and x.dim() == 2:
        return linear_relu(x, weight, bias)
    out = F.linear(x, weight, bias)
    return torch.relu(out) if relu else out
