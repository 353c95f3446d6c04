"""DLRM interactions: the pairwise dot interaction and the DCN-v2 cross network.

Input ``x`` is [B, F+1, D]: row 0 is the dense vector from the bottom MLP, rows 1..F
the pooled embeddings of the F sparse fields. With R = F+1 rows, the output is
[B, D + R(R-1)/2]: the dense vector, then the dot products ``<x[:, i], x[:, j]>`` of
every pair ``i < j`` in row-major order of the strict upper triangle
((0,1), (0,2), ..., (0,F), (1,2), ..., (F-1,F)), the order of
``torch.triu_indices(R, R, offset=1)``. Pair ``(i, j)`` sits at column
``D + i*R - i(i+1)/2 + (j-i-1)``. With ``pad=True`` the row is zero-padded to a multiple
of 8 elements (:func:`interaction_output_dim`), so a consumer's GEMM reads aligned rows;
a layer taking the padded width with zero weights on the padding computes the same.

:func:`dot_interaction_pair` takes row 0 (``dense`` [B, D]) and rows 1..F (``pooled``
[B, F, D]) as two tensors; the triton backend reads both in place, with no concatenation.

Backends: ``reference`` (bmm, triangle gather, cat; the specification, in
:mod:`recaccel.ops.interaction.reference`) and ``triton`` (fused forward and backward
kernels in :mod:`recaccel.ops.interaction.triton`); :func:`dot_interaction` picks one.

DCN-v2 (:func:`dcnv2_cross`): L low-rank cross layers over ``x0`` [B, K],
``x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l``; reference in
:mod:`recaccel.ops.interaction.dcnv2_reference`, fused Triton kernels (all layers in one
launch) in :mod:`recaccel.ops.interaction.dcnv2_triton`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recaccel.config import InteractionBackend
from recaccel.ops.backend import op_backends, resolve_backend
from recaccel.ops.interaction.dcnv2_reference import (
    CROSS_KERNELS,
    CROSS_TRITON_DTYPES,
    check_cross_input,
    dcnv2_cross_backward_reference,
    dcnv2_cross_reference,
    init_cross_weights,
)
from recaccel.ops.interaction.reference import (
    PAD_MULTIPLE,
    TRITON_DTYPES,
    check_interaction_input,
    check_interaction_pair,
    dot_interaction_backward_reference,
    dot_interaction_reference,
    interaction_output_dim,
    pair_indices,
    symmetric_from_pairs,
)

__all__ = [
    "CROSS_KERNELS",
    "CROSS_TRITON_DTYPES",
    "PAD_MULTIPLE",
    "TRITON_DTYPES",
    "DotInteraction",
    "check_cross_input",
    "check_interaction_input",
    "check_interaction_pair",
    "dcnv2_cross",
    "dcnv2_cross_backward_reference",
    "dcnv2_cross_reference",
    "dot_interaction",
    "dot_interaction_backward_reference",
    "dot_interaction_pair",
    "dot_interaction_reference",
    "init_cross_weights",
    "interaction_output_dim",
    "pair_indices",
    "symmetric_from_pairs",
]

_BACKENDS = op_backends(InteractionBackend)  # reference, triton


def dot_interaction(x: Tensor, backend: str = "auto", *, pad: bool = False) -> Tensor:
    """DLRM dot interaction: the dense row, then all pairwise dot products of rows.

    Args:
        x: [B, F+1, D] float32, bfloat16 or float16; row 0 dense, rows 1..F pooled
            embeddings. Products accumulate in float32 on the triton path.
        backend: ``"auto"`` (triton on CUDA for :data:`TRITON_DTYPES`, else reference),
            ``"reference"`` or ``"triton"``.
        pad: Zero-pad each output row to a multiple of :data:`PAD_MULTIPLE` elements.

    Returns:
        [B, D + (F+1)F/2 (padded)] in ``x``'s dtype; see the module docstring for the order.

    Raises:
        ValueError: bad shape or dtype, or unknown backend.
        RuntimeError: triton requested where it cannot run.
    """
    check_interaction_input(x)
    if _use_reference(backend, x):
        return dot_interaction_reference(x, pad)
    from recaccel.ops.interaction import triton as interaction_triton

    return interaction_triton.dot_interaction_triton(x, pad)


def dot_interaction_pair(
    dense: Tensor, pooled: Tensor, backend: str = "auto", *, pad: bool = False
) -> Tensor:
    """:func:`dot_interaction` of ``cat([dense[:, None], pooled], 1)``, without the concatenation.

    Args:
        dense: [B, D], row 0 (the bottom MLP's output).
        pooled: [B, F, D], rows 1..F (the pooled embeddings); ``dense``'s dtype and device.
        backend: as in :func:`dot_interaction`.
        pad: Zero-pad each output row to a multiple of :data:`PAD_MULTIPLE` elements.

    Returns:
        [B, D + (F+1)F/2 (padded)] in the inputs' dtype.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or unknown backend.
        RuntimeError: triton requested where it cannot run.
    """
    check_interaction_pair(dense, pooled)
    if _use_reference(backend, dense):
        return dot_interaction_reference(torch.cat([dense.unsqueeze(1), pooled], dim=1), pad)
    from recaccel.ops.interaction import triton as interaction_triton

    return interaction_triton.dot_interaction_pair_triton(dense, pooled, pad)


def _use_reference(backend: str, x: Tensor) -> bool:
    """True when ``backend`` resolves to the reference for ``x`` (auto: float64 too)."""
    name = resolve_backend(backend, x.device, available=_BACKENDS, op="dot_interaction")
    return name == "reference" or (backend == "auto" and x.dtype not in TRITON_DTYPES)


def dcnv2_cross(
    x0: Tensor, u: Tensor, v: Tensor, b: Tensor, backend: str = "auto", kernel: str = "gemm"
) -> Tensor:
    """DCN-v2 low-rank cross network: L layers ``x_{l+1} = x0 * (x_l V_l^T U_l^T + b_l) + x_l``.

    Args:
        x0: [B, K] float32, bfloat16 or float16 (float64 on the reference only).
        u: [L, K, r], v: [L, r, K], b: [L, K], all in ``x0``'s dtype and device.
        backend: ``"auto"`` (triton on CUDA for :data:`CROSS_TRITON_DTYPES`, else
            reference), ``"reference"`` or ``"triton"``.
        kernel: what the triton backend runs (``model.dcn_kernel``): ``"gemm"`` (library
            GEMMs and one fused elementwise kernel per layer,
            :mod:`~recaccel.ops.interaction.dcnv2_gemm`) or ``"fused"`` (every layer in one
            launch, :mod:`~recaccel.ops.interaction.dcnv2_triton`).

    Returns:
        x_L [B, K] in ``x0``'s dtype.

    Raises:
        ValueError: bad shapes or dtypes, or unknown backend.
        RuntimeError: triton requested where it cannot run.
    """
    check_cross_input(x0, u, v, b)
    if kernel not in CROSS_KERNELS:
        raise ValueError(f"dcnv2_cross: unknown kernel {kernel!r}; expected one of {CROSS_KERNELS}")
    name = resolve_backend(backend, x0.device, available=_BACKENDS, op="dcnv2_cross")
    if name == "reference" or (backend == "auto" and x0.dtype not in CROSS_TRITON_DTYPES):
        return dcnv2_cross_reference(x0, u, v, b)
    if kernel == "gemm":
        from recaccel.ops.interaction import dcnv2_gemm

        return dcnv2_gemm.dcnv2_cross_gemm(x0, u, v, b)
    from recaccel.ops.interaction import dcnv2_triton

    return dcnv2_triton.dcnv2_cross_triton(x0, u, v, b)


class DotInteraction(nn.Module):
    """Module form of :func:`dot_interaction` (no parameters).

    Args:
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
        pad: Zero-pad each output row to a multiple of :data:`PAD_MULTIPLE` elements.
    """

    def __init__(self, backend: str = "auto", pad: bool = False) -> None:
        super().__init__()
        if backend != "auto" and backend not in _BACKENDS:
            raise ValueError(
                f"DotInteraction: unknown backend {backend!r}; expected 'auto' or one of {_BACKENDS}"
            )
        self.backend = backend
        self.pad = pad

    @staticmethod
    def output_dim(num_fields: int, dim: int, pad: bool = False) -> int:
        """Output width for F sparse fields of dim D (padded to a multiple of 8 if ``pad``)."""
        return interaction_output_dim(num_fields, dim, pad=pad)

    def forward(self, x: Tensor) -> Tensor:
        """[B, F+1, D] -> [B, D + (F+1)F/2 (padded)]."""
        return dot_interaction(x, self.backend, pad=self.pad)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, pad={self.pad}"
