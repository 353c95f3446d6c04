"""The correctness gate of the kernel benchmarks whose candidates compute one function:
before timing, every candidate's forward and gradients are compared with the float64 result.

The bound is the one the kernels' own tests use: a candidate's relative error (Frobenius
norm of the difference over the norm of the float64 result) must stay within
:data:`FACTOR` times the eager reference's own error in the same dtype, plus
:data:`FLOOR`. A low-precision eager reference rounds after every op, so its error sets
the scale; a wrong kernel is off by far more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from recaccel.errors import RecaccelError

FACTOR = 4.0  # Triton's interpreter truncates to bfloat16 where CUDA rounds to nearest
FLOOR = 1e-3


class CandidateMismatchError(RecaccelError):
    """A candidate's forward or gradient differs from the float64 result beyond the bound."""


def relative_error(got: Tensor, exact: Tensor) -> float:
    """``|got - exact| / |exact|`` in Frobenius norm, in float64 (inf where ``got`` is not finite)."""
    got = got.detach().double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - exact).norm() / exact.norm().clamp_min(1e-30))


def max_relative_error(got: Tensor, want: Tensor) -> float:
    """``max |got - want| / max |want|`` in float64 (NaN where ``got`` has one): the bound of
    benches whose outputs are judged element-wise (a single far-off value counts)."""
    want = want.detach().double()
    return float((got.detach().double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def forward_and_grads(fn: Callable[..., Tensor], inputs: Sequence[Tensor], grad: Tensor) -> list[Tensor]:
    """``[forward under no_grad, forward with autograd, d<out, grad>/d input for each input]``:
    both forwards, since a candidate may dispatch differently without autograd."""
    with torch.no_grad():
        plain = fn(*inputs)
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [plain, out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


def check_against_float64(
    bench: str,
    reference: Callable[..., Tensor],
    candidates: Mapping[str, Callable[..., Tensor]],
    inputs: Sequence[Tensor],
    grad: Tensor,
    input_names: Sequence[str],
) -> dict[str, dict[str, float]]:
    """Checks each candidate's outputs against ``reference`` run in float64 on the same inputs.

    Returns:
        ``{name: {"forward": error, "grad": largest gradient error}}`` for ``"eager"``
        (``reference`` in the inputs' dtype) and every candidate.

    Raises:
        CandidateMismatchError: one line naming the bench, the candidate, the output and the bound.
    """
    parts = ["forward", "forward (autograd)", *(f"gradient of {n}" for n in input_names)]
    exact = [t.double() for t in forward_and_grads(reference, [t.double() for t in inputs], grad.double())]
    eager = [
        relative_error(t, x) for t, x in zip(forward_and_grads(reference, inputs, grad), exact, strict=True)
    ]
    limits = [FACTOR * e + FLOOR for e in eager]
    out = {"eager": _summary(eager)}
    for name, fn in candidates.items():
        errors = [
            relative_error(t, x) for t, x in zip(forward_and_grads(fn, inputs, grad), exact, strict=True)
        ]
        for part, err, own, limit in zip(parts, errors, eager, limits, strict=True):
            if not err <= limit:
                raise CandidateMismatchError(
                    f"{bench}: candidate {name!r} {part} differs from the float64 reference: relative error "
                    f"{err:.3g} > {limit:.3g} ({FACTOR:g} x eager's {own:.3g} + {FLOOR:g}); nothing is timed"
                )
        out[name] = _summary(errors)
    return out


def _summary(errors: Sequence[float]) -> dict[str, float]:
    return {"forward": max(errors[:2]), "grad": max(errors[2:], default=0.0)}
