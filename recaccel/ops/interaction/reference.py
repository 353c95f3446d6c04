"""DLRM dot interaction in plain PyTorch: the specification, and the checks both backends share.

See :mod:`recaccel.ops.interaction` for the output layout.

Shapes: B batch, R = F+1 rows (row 0 dense), D dim, P = R(R-1)/2 pairs.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The dtypes the triton backend takes (here, beside the checks both backends share, so
# the dispatch reads it without importing Triton).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# A padded output row is a multiple of this many elements (16 bytes in bf16, 32 in float32),
# so the top MLP's first GEMM reads aligned rows.
PAD_MULTIPLE = 8


def interaction_output_dim(num_fields: int, dim: int, *, pad: bool = False) -> int:
    """Width of the interaction output for F sparse fields and embedding dim D: D + (F+1)F/2,
    rounded up to a multiple of :data:`PAD_MULTIPLE` when ``pad``."""
    width = dim + (num_fields + 1) * num_fields // 2
    return -(-width // PAD_MULTIPLE) * PAD_MULTIPLE if pad else width


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


def check_interaction_pair(dense: Tensor, pooled: Tensor) -> None:
    """Raises ValueError unless ``dense`` [B, D] and ``pooled`` [B, F, D] (F >= 0, D >= 1)
    agree in B and D, dtype (floating point) and device."""
    if dense.dim() != 2 or pooled.dim() != 3:
        raise ValueError(
            f"dot_interaction expects dense [B, D] and pooled [B, F, D], got shapes "
            f"{tuple(dense.shape)} and {tuple(pooled.shape)}"
        )
    if dense.shape[0] != pooled.shape[0] or dense.shape[1] != pooled.shape[2]:
        raise ValueError(
            f"dot_interaction: dense {tuple(dense.shape)} and pooled {tuple(pooled.shape)} disagree in B or D"
        )
    if dense.dtype != pooled.dtype or not dense.is_floating_point():
        raise ValueError(
            f"dot_interaction expects floating-point dense and pooled of one dtype, got "
            f"{dense.dtype} and {pooled.dtype}"
        )
    if dense.device != pooled.device:
        raise ValueError(f"dot_interaction: dense on {dense.device}, pooled on {pooled.device}")
    if dense.shape[1] < 1:
        raise ValueError(f"dot_interaction needs at least one column, got dense {tuple(dense.shape)}")


def dot_interaction_reference(x: Tensor, pad: bool = False) -> Tensor:
    """Dot interaction in plain PyTorch (the specification; differentiable to any order).

    Args:
        x: [B, F+1, D]; row 0 dense, rows 1..F pooled embeddings.
        pad: Zero-pad each output row to a multiple of :data:`PAD_MULTIPLE` elements.

    Returns:
        [B, D + (F+1)F/2 (padded)] in ``x``'s dtype.
    """
    check_interaction_input(x)
    iu, ju = pair_indices(x.shape[1], x.device)
    gram = torch.bmm(x, x.transpose(1, 2))
    out = torch.cat([x[:, 0], gram[:, iu, ju]], dim=1)
    if not pad:
        return out
    width = interaction_output_dim(x.shape[1] - 1, x.shape[2], pad=True)
    return torch.nn.functional.pad(out, (0, width - out.shape[1]))


def dot_interaction_backward_reference(grad_out: Tensor, x: Tensor) -> Tensor:
    """Gradient of :func:`dot_interaction_reference` w.r.t. ``x``, written out.

    ``grad_x = (G + G^T) x`` with G the pair gradients scattered into the strict upper
    triangle of an [R, R] matrix, plus the dense gradient on row 0: the specification
    the Triton backward kernel is tested against.

    Args:
        grad_out: [B, D + R(R-1)/2], or its padded width.
        x: [B, R, D].

    Returns:
        [B, R, D] in ``x``'s dtype.
    """
    r, d = x.shape[1], x.shape[2]
    pairs = grad_out[:, d : interaction_output_dim(r - 1, d)]  # padding columns have no input
    sym = symmetric_from_pairs(pairs.to(x.dtype), r)
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
