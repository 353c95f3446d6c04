"""DLRM pairwise dot interaction.

Input ``x`` is [B, F+1, D]: row 0 is the dense vector from the bottom MLP, rows 1..F
the pooled embeddings of the F sparse fields. With R = F+1 rows, the output is
[B, D + R(R-1)/2]: the dense vector, then the dot products ``<x[:, i], x[:, j]>`` of
every pair ``i < j`` in row-major order of the strict upper triangle
((0,1), (0,2), ..., (0,F), (1,2), ..., (F-1,F)), the order of
``torch.triu_indices(R, R, offset=1)``. Pair ``(i, j)`` sits at column
``D + i*R - i(i+1)/2 + (j-i-1)``.

Backends: ``reference`` (bmm, triangle gather, cat; the specification) and ``triton``
(fused forward and backward kernels in :mod:`recaccel.ops.interaction.triton`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recaccel.ops.backend import resolve_backend

_BACKENDS = ("reference", "triton")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interaction_output_dim(num_fields: int, dim: int) -> int:
    """Width of the interaction output for F sparse fields and embedding dim D: D + (F+1)F/2."""
    return dim + (num_fields + 1) * num_fields // 2


def pair_indices(num_rows: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """Row and column indices (int64 [P] each) of the strict upper triangle, row-major."""
    iu = torch.triu_indices(num_rows, num_rows, offset=1, device=device)
    return iu[0], iu[1]


def check_interaction_input(x: Tensor) -> None:
    """Raises ValueError unless ``x`` is a floating [B, F+1, D] tensor with F+1 >= 1 and D >= 1."""
    if x.dim() != 3:
        raise ValueError(f"dot_interaction expects x of shape [B, F+1, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"dot_interaction expects a floating-point x, got dtype {x.dtype}")
    if x.shape[1] < 1 or x.shape[2] < 1:
        raise ValueError(f"dot_interaction needs at least one row and one column, got shape {tuple(x.shape)}")


def dot_interaction_reference(x: Tensor) -> Tensor:
    """Dot interaction in plain PyTorch (the specification; differentiable to any order).

    Args:
        x: [B, F+1, D]; row 0 dense, rows 1..F pooled embeddings.

    Returns:
        [B, D + (F+1)F/2] in ``x``'s dtype.
    """
    check_interaction_input(x)
    iu, ju = pair_indices(x.shape[1], x.device)
    gram = torch.bmm(x, x.transpose(1, 2))
    return torch.cat([x[:, 0], gram[:, iu, ju]], dim=1)


def dot_interaction_backward_reference(grad_out: Tensor, x: Tensor) -> Tensor:
    """Gradient of :func:`dot_interaction_reference` w.r.t. ``x``, written out.

    ``grad_x = (G + G^T) x`` with G the pair gradients scattered into the strict upper
    triangle of an [R, R] matrix, plus the dense gradient on row 0: the specification
    the Triton backward kernel is tested against.

    Args:
        grad_out: [B, D + R(R-1)/2].
        x: [B, R, D].

    Returns:
        [B, R, D] in ``x``'s dtype.
    """
    r, d = x.shape[1], x.shape[2]
    sym = symmetric_from_pairs(grad_out[:, d:].to(x.dtype), r)
    grad_x = torch.bmm(sym, x)
    dense = torch.zeros_like(grad_x)
    dense[:, 0] = grad_out[:, :d].to(x.dtype)
    return grad_x + dense


def symmetric_from_pairs(pairs: Tensor, num_rows: int) -> Tensor:
    """Scatters [B, P] pair values into symmetric [B, R, R] matrices with a zero diagonal."""
    iu, ju = pair_indices(num_rows, pairs.device)
    upper = pairs.new_zeros(pairs.shape[0], num_rows, num_rows)
    upper = upper.index_put((torch.arange(pairs.shape[0], device=pairs.device)[:, None], iu, ju), pairs)
    return upper + upper.transpose(1, 2)


def dot_interaction(x: Tensor, backend: str = "auto") -> Tensor:
    """DLRM dot interaction: the dense row, then all pairwise dot products of rows.

    Args:
        x: [B, F+1, D] float32, bfloat16 or float16; row 0 dense, rows 1..F pooled
            embeddings. Products accumulate in float32 on the triton path.
        backend: ``"auto"`` (triton on CUDA for :data:`TRITON_DTYPES`, else reference),
            ``"reference"`` or ``"triton"``.

    Returns:
        [B, D + (F+1)F/2] in ``x``'s dtype; see the module docstring for the order.

    Raises:
        ValueError: bad shape or dtype, or unknown backend.
        RuntimeError: triton requested where it cannot run.
    """
    check_interaction_input(x)
    name = resolve_backend(backend, x.device, available=_BACKENDS, op="dot_interaction")
    if name == "reference" or (backend == "auto" and x.dtype not in TRITON_DTYPES):
        return dot_interaction_reference(x)
    from recaccel.ops.interaction import triton as interaction_triton

    return interaction_triton.dot_interaction_triton(x)


class DotInteraction(nn.Module):
    """Module form of :func:`dot_interaction` (no parameters).

    Args:
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
    """

    def __init__(self, backend: str = "auto") -> None:
        super().__init__()
        if backend != "auto" and backend not in _BACKENDS:
            raise ValueError(
                f"DotInteraction: unknown backend {backend!r}; expected 'auto' or one of {_BACKENDS}"
            )
        self.backend = backend

    @staticmethod
    def output_dim(num_fields: int, dim: int) -> int:
        """Output width for F sparse fields of dim D."""
        return interaction_output_dim(num_fields, dim)

    def forward(self, x: Tensor) -> Tensor:
        """[B, F+1, D] -> [B, D + (F+1)F/2]."""
        return dot_interaction(x, self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"
