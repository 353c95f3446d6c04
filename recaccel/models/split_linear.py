"""MLP layers whose backward is split into the input gradient and deferred weight gradients.

A Linear layer's backward is two GEMMs of equal cost: dgrad (``dL/dx = g @ W``), which
the layers below need, and wgrad (``dL/dW = g^T @ x``, and ``dL/db = sum(g)``), which
nothing needs until the dense optimizer step. :func:`split_dense_layer` runs a layer
whose autograd backward computes dgrad only and puts the wgrad work on a
:class:`WgradQueue`, in the spirit of zero-bubble pipeline schedules' B/W split; the
caller runs the queue after ``backward()`` returns. The gradient therefore reaches the
interaction, and the embedding's fused sparse update inside its backward, without
waiting for any weight-gradient GEMM (:mod:`recaccel.train.loop.overlap`).

Exactness: every GEMM and reduction is the one autograd runs for the unsplit layer
(:func:`recaccel.models.fused_linear.dense_layer`), on the same operands in the same
layout, and the casts and paddings of autocast and alignment are undone the way their
own backwards do; the weight gradients are accumulated into ``.grad`` as autograd's
accumulation does (set when None, added in place otherwise). So on the same device the
gradients are those of the unsplit layer, bit for bit.

Not for second-order gradients (the backward is ``once_differentiable``): the meta
engines never use it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from recaccel.models.fused_linear import aligned_operands, relu_backward


class WgradQueue:
    """Weight-gradient work deferred by split layers' backwards, run in the order queued."""

    def __init__(self) -> None:
        self._work: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._work)

    def put(self, work: Callable[[], None]) -> None:
        """Queues ``work`` (it computes and accumulates some parameters' gradients)."""
        self._work.append(work)

    def run(self) -> None:
        """Runs and empties the queue (emptied first: work that raises is not run twice)."""
        work, self._work = self._work, []
        for item in work:
            item()

    def clear(self) -> None:
        """Drops the queued work (a backward that raised: its gradients are not wanted)."""
        self._work.clear()


def accumulate_grad(param: Tensor, grad: Tensor) -> None:
    """Adds ``grad`` to ``param.grad`` as autograd's accumulation does: sets it (in the
    parameter's layout) when None, adds in place otherwise."""
    if param.grad is None:
        param.grad = grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)
    else:
        param.grad.add_(grad)


def _is_column_major(t: Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) == t.shape[0]


class _SplitLinear(torch.autograd.Function):
    """``F.linear`` (or its bias + ReLU epilogue form) with wgrad deferred to a queue.

    The operands arrive already cast and padded and detached from the parameters;
    ``spec`` holds the parameters and turns the operands' gradients into theirs.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, param: Tensor, spec: _Spec) -> Tensor:
        del param  # an input only so that autograd records the node (x may not need a gradient)
        with torch.autocast(x.device.type, enabled=False):
            if spec.fused_relu:
                out = torch._addmm_activation(b, x, w.t(), use_gelu=False)
            else:
                out = F.linear(x, w, b)
        ctx.spec = spec
        ctx.save_for_backward(x, w, out if spec.fused_relu else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        x, w, out = ctx.saved_tensors
        spec: _Spec = ctx.spec
        if spec.fused_relu:
            # _LinearReLU's backward (recaccel.models.fused_linear), wgrad deferred.
            g, grad_b = relu_backward(grad, out)
            grad_x = g.mm(w) if ctx.needs_input_grad[0] else None
            spec.queue.put(lambda: spec.restore(g.t().mm(x), g.sum(0) if grad_b is None else grad_b))
            return grad_x, None, None, None, None
        # addmm's backward (torch's mm_mat1_backward / mm_mat2_backward), wgrad deferred.
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = w.t().mm(grad.t()).t() if _is_column_major(x) else grad.mm(w)
        spec.queue.put(lambda: spec.restore(grad.t().mm(x), grad.sum(0) if spec.bias is not None else None))
        return grad_x, None, None, None, None


class _Spec:
    """One call's deferred-gradient bookkeeping: the parameters, what their operands went
    through (cast to ``dtype``, weight padded to more columns), and the queue."""

    def __init__(
        self, weight: nn.Parameter, bias: Tensor | None, fused_relu: bool, queue: WgradQueue
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.fused_relu = fused_relu
        self.queue = queue

    def restore(self, grad_w: Tensor, grad_b: Tensor | None) -> None:
        """Undoes the cast (to the parameter's dtype) and the padding (a column slice) as
        their backwards do, then accumulates into ``.grad``."""
        w = self.weight
        if w.requires_grad:
            g = grad_w.to(w.dtype)
            if g.shape[1] != w.shape[1]:
                g = g[:, : w.shape[1]].contiguous()
            accumulate_grad(w, g)
        if grad_b is not None and self.bias.requires_grad:
            accumulate_grad(self.bias, grad_b.to(self.bias.dtype))


def split_dense_layer(
    x: Tensor,
    weight: nn.Parameter,
    bias: Tensor | None,
    *,
    relu: bool,
    fused: bool,
    align: bool,
    queue: WgradQueue,
) -> Tensor:
    """:func:`recaccel.models.fused_linear.dense_layer` with its weight gradients deferred
    to ``queue`` (same arguments; see that function). Call under grad mode; the queued
    work must run after ``backward()`` for the parameters to receive their gradients."""
    # The input's padding and cast stay autograd ops: their backwards carry dgrad on exactly
    # as in the unsplit layer. The weight's are undone by the queued work (_Spec.restore).
    x, w = aligned_operands(x, weight.detach()) if align else (x, weight.detach())
    b = None if bias is None else bias.detach()
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # Autocast's casts of F.linear's operands (the fused form casts the same way).
        dtype = torch.get_autocast_dtype(device_type)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    fused_relu = fused and relu and bias is not None and x.dim() == 2
    out = _SplitLinear.apply(x, w, b, weight, _Spec(weight, bias, fused_relu, queue))
    if relu and not fused_relu:
        out = torch.relu(out)
    return out
