"""DLRM interactions: the pairwise dot interaction and the DCN-v2 cross network.

Input ``x`` is [B, F+1, D]: row 0 is the dense vector from the bottom MLP, rows 1..F
the pooled embeddings of the F sparse fields. With R = F+1 rows, the output is
[B, D + R(R-1)/2]: the dense vector, then the dot products ``<x[:, i], x[:, j]>`` of
every pair ``i < j`` in row-major order of the strict upper triangle
((0,1), (0,2), ..., (0,F), (1,2), ..., (F-1,F)), the order of
``torch.triu_indices(R, R, offset=1)``. Pair ``(i, j)`` sits at column
``D + i*R - i(i+1)/2 + (j-i-1)``.

Backends: ``reference`` (bmm, triangle gather, cat; the specification, in
:mod:`recaccel.ops.interaction.reference`) and ``triton`` (fused forward and backward
kernels in :mod:`recaccel.ops.interaction.triton`); :func:`dot_interaction` picks one.

DCN-v2 (:func:`dcnv2_cross`): L low-rank cross layers over ``x0`` [B, K],
``x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l``; reference in
:mod:`recaccel.ops.interaction.dcnv2_reference`, fused Triton kernels (all layers in one
launch) in :mod:`recaccel.ops.interaction.dcnv2_triton`.
"""

from __future__ import annotations

from torch import Tensor, nn

from recaccel.config import InteractionBackend
from recaccel.ops.backend import op_backends, resolve_backend
from recaccel.ops.interaction.dcnv2_reference import (
    CROSS_TRITON_DTYPES,
    check_cross_input,
    dcnv2_cross_backward_reference,
    dcnv2_cross_reference,
    init_cross_weights,
)
from recaccel.ops.interaction.reference import (
    TRITON_DTYPES,
    check_interaction_input,
    dot_interaction_backward_reference,
    dot_interaction_reference,
    interaction_output_dim,
    pair_indices,
    symmetric_from_pairs,
)

__all__ = [
    "CROSS_TRITON_DTYPES",
    "TRITON_DTYPES",
    "DotInteraction",
    "check_cross_input",
    "check_interaction_input",
    "dcnv2_cross",
    "dcnv2_cross_backward_reference",
    "dcnv2_cross_reference",
    "dot_interaction",
    "dot_interaction_backward_reference",
    "dot_interaction_reference",
    "init_cross_weights",
    "interaction_output_dim",
    "pair_indices",
    "symmetric_from_pairs",
]

_BACKENDS = op_backends(InteractionBackend)  # reference, triton


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


def dcnv2_cross(x0: Tensor, u: Tensor, v: Tensor, b: Tensor, backend: str = "auto") -> Tensor:
    """DCN-v2 low-rank cross network: L layers ``x_{l+1} = x0 * (x_l V_l^T U_l^T + b_l) + x_l``.

    Args:
        x0: [B, K] float32, bfloat16 or float16 (float64 on the reference only).
        u: [L, K, r], v: [L, r, K], b: [L, K], all in ``x0``'s dtype and device.
        backend: ``"auto"`` (triton on CUDA for :data:`CROSS_TRITON_DTYPES`, else
            reference), ``"reference"`` or ``"triton"``.

    Returns:
        x_L [B, K] in ``x0``'s dtype.

    Raises:
        ValueError: bad shapes or dtypes, or unknown backend.
        RuntimeError: triton requested where it cannot run.
    """
    check_cross_input(x0, u, v, b)
    name = resolve_backend(backend, x0.device, available=_BACKENDS, op="dcnv2_cross")
    if name == "reference" or (backend == "auto" and x0.dtype not in CROSS_TRITON_DTYPES):
        return dcnv2_cross_reference(x0, u, v, b)
    from recaccel.ops.interaction import dcnv2_triton

    return dcnv2_triton.dcnv2_cross_triton(x0, u, v, b)


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
