"""The autograd Function both DCN-v2 fast paths share (the fused one-launch kernel of
:mod:`~recaccel.ops.interaction.dcnv2_triton` and the GEMM path of
:mod:`~recaccel.ops.interaction.dcnv2_gemm`).

Each path is a pair of ``torch.library`` custom ops: a forward returning the output and the
per-layer intermediates (xs, hs, ys) the backward reads, and a backward returning the
gradients of (x0, U, V, b). A backward that is itself differentiated (``create_graph``:
the meta engines' second order) goes through the reference, which records a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recaccel.ops.interaction.dcnv2_reference import dcnv2_cross_reference

CrossOp = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]


def empty_gradients(x0: Tensor, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised (dx0 [B, K], dU [L, K, r], dV [L, r, K], db [L, K]): the shapes both paths'
    backward ops return, for their fake (meta) implementations."""
    return (
        x0.new_empty(x0.shape),
        u.new_empty(u.shape),
        v.new_empty(v.shape),
        u.new_empty(u.shape[0], u.shape[1]),
    )


def register_cross_ops(
    name: str, forward: CrossOp, backward: CrossOp, *, layer_major: bool
) -> tuple[CrossOp, CrossOp]:
    """Registers one path's forward and backward as ``recaccel::<name>`` and
    ``recaccel::<name>_backward`` custom ops, with fake (meta) implementations.

    Args:
        name: The forward op's name in the ``recaccel`` namespace.
        forward: ``(x0, U, V, b) -> (out [B, K], xs, hs, ys)``.
        backward: ``(grad_out, x0, U, V, xs, hs, ys) -> (dx0, dU, dV, db)``.
        layer_major: Whether the intermediates are [L, B, .] (else [B, L, .]).
    """

    def forward_op(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return forward(x0, u, v, b)

    def forward_fake(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        rows, k = x0.shape
        layers, _, rank = u.shape

        def saved(n: int, width: int) -> Tensor:
            return x0.new_empty(n, rows, width) if layer_major else x0.new_empty(rows, n, width)

        return x0.new_empty(rows, k), saved(layers - 1, k), saved(layers, rank), saved(layers, k)

    def backward_op(
        grad_out: Tensor, x0: Tensor, u: Tensor, v: Tensor, xs: Tensor, hs: Tensor, ys: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return backward(grad_out, x0, u, v, xs, hs, ys)

    def backward_fake(grad_out, x0, u, v, xs, hs, ys) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return empty_gradients(x0, u, v)

    fwd = torch.library.custom_op(f"recaccel::{name}", forward_op, mutates_args=())
    fwd.register_fake(forward_fake)
    bwd = torch.library.custom_op(f"recaccel::{name}_backward", backward_op, mutates_args=())
    bwd.register_fake(backward_fake)
    return fwd, bwd


def cross_function(forward_op: CrossOp, backward_op: CrossOp, what: str) -> type[torch.autograd.Function]:
    """An autograd Function over one path's forward and backward custom ops.

    Args:
        forward_op: ``(x0 [B, K], U [L, K, r], V [L, r, K], b [L, K]) -> (out [B, K], xs, hs, ys)``.
        backward_op: ``(grad_out, x0, U, V, xs, hs, ys) -> (dx0, dU, dV, db)``.
        what: the path, for the Function's docstring.
    """

    class CrossFunction(torch.autograd.Function):
        @staticmethod
        def forward(x0: Tensor, u: Tensor, v: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            return forward_op(x0, u, v, b)

        @staticmethod
        def setup_context(ctx, inputs, output) -> None:
            _, xs, hs, ys = output
            ctx.mark_non_differentiable(xs, hs, ys)
            ctx.save_for_backward(*inputs, xs, hs, ys)

        @staticmethod
        def backward(ctx, grad_out: Tensor, *_unused: Tensor) -> tuple[Tensor | None, ...]:
            x0, u, v, b, xs, hs, ys = ctx.saved_tensors
            if torch.is_grad_enabled():
                return _reference_backward(ctx, grad_out, (x0, u, v, b))
            grads = backward_op(grad_out, x0, u, v, xs, hs, ys)
            return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=True))

    CrossFunction.__doc__ = f"Autograd over the {what} forward and backward ops."
    return CrossFunction


def _reference_backward(ctx, grad_out: Tensor, inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """The gradients of the reference with a graph, for a backward that is differentiated again."""
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad, strict=True) if need]
    out = dcnv2_cross_reference(*inputs)
    grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=True))
    return tuple(next(grads) if need else None for need in ctx.needs_input_grad)
