"""Sparse optimizers of a packed buffer: their state and the reference update rules.

The rules are documented on :class:`~recaccel.ops.embedding.specs.SparseOptimConfig`;
this module is their executable definition, which the Triton fused kernel and FBGEMM are
tested against.

Shapes: R packed rows, D dim, U unique rows touched by a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.ops.embedding.rounding import stochastic_round
from recaccel.ops.embedding.specs import OPTIMIZER_STATES, SparseOptimConfig


@dataclass
class PackState:
    """The tensors of one pack that an update touches.

    Attributes:
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``.
        weight: [R, D] packed rows, float32, bfloat16 or float16 (updated in place).
        states: Optimizer state by name: ``momentum1`` [R] (row-wise Adagrad) or
            ``momentum1``/``momentum2`` [R, D] (Adam).
        step: int64 scalar CPU tensor, the pack's update count (Adam's ``t``); a CPU
            tensor so that reading it never waits for the GPU.
        rounding_seed: 16-bit rows: draws the 32-bit seed of one update's stochastic
            rounding (:mod:`~recaccel.ops.embedding.rounding`); None for float32 rows.
        lr: float32 [1] on the weight's device: the learning rate as the Triton update
            kernels read it (the pack's, made when the rate changes, or refilled in place
            for a captured step: ``PackedEmbeddingBag.keep_rates_in_place``); None: the
            kernels' launcher makes one from ``optim.lr``. The other backends read ``optim.lr``.
    """

    optimizer: str
    weight: Tensor
    states: dict[str, Tensor]
    step: Tensor
    rounding_seed: Callable[[], int] | None = None
    lr: Tensor | None = None


def init_states(optimizer: str, num_rows: int, dim: int, device: torch.device) -> dict[str, Tensor]:
    """Zero optimizer state for a pack of ``num_rows`` x ``dim``."""
    return {
        name: torch.zeros((num_rows,) if rowwise else (num_rows, dim), dtype=torch.float32, device=device)
        for name, rowwise in OPTIMIZER_STATES[optimizer]
    }


def adam_bias_corrections(optim: SparseOptimConfig, step: Tensor | int) -> tuple[float, float]:
    """``(1 - beta1^t, 1 - beta2^t)`` for Adam's step ``t`` (computed in float64).

    ``step`` may be the pack's step counter, a CPU tensor: read through ``numpy()``,
    which refuses a device tensor, so this never waits for the device.
    """
    t = int(step.numpy()) if isinstance(step, Tensor) and not step.is_cuda else int(step)
    return 1.0 - optim.beta1**t, 1.0 - optim.beta2**t


# Rows updated per piece: a piece's rows are read, updated and written back while they
# are still in cache, and its temporaries stay small enough (~1 MB) for the allocator to
# recycle instead of mapping fresh, page-faulting memory every step.
MAX_ROWS_PER_PIECE = 65536
PIECE_FLOATS = 2**18


def rows_per_piece(dim: int) -> int:
    """Unique rows per piece of a coalesce-and-update pass: [rows, D] float32 is ~1 MB."""
    return max(1024, min(MAX_ROWS_PER_PIECE, PIECE_FLOATS // max(dim, 1)))


@torch.no_grad()
def update_rows(
    state: PackState, optim: SparseOptimConfig, rows: Tensor, grad: Tensor, seed: int | None = None
) -> None:
    """Applies one sparse optimizer step to some rows, in place; the caller counts the step.

    The caller adds 1 to ``state.step`` once per step, before its first call (Adam reads
    it), then updates the rows the step touched in one call or in pieces
    (:func:`rows_per_piece`): each row is updated independently of the others. Rows are read with ``index_select`` and written back
    with ``index_copy_`` (both faster than ``x[rows]`` on the CPU), hence ``rows`` unique.
    16-bit rows are upcast, updated in float32 and written back with stochastic rounding
    (:func:`~recaccel.ops.embedding.rounding.stochastic_round`).

    Args:
        state: The pack's weight and optimizer state (updated in place); ``step`` is read.
        optim: Hyper-parameters.
        rows: int64 [U] unique packed rows.
        grad: float32 [U, D] summed gradient of each row (not modified).
        seed: 16-bit rows: this step's rounding seed (one per step, shared by its pieces).
    """
    weight = state.weight
    w = weight.index_select(0, rows)
    low = weight.dtype in (torch.bfloat16, torch.float16)  # float64 rows update in float64
    if low:
        w = w.float()
    lr, wd = optim.lr, optim.weight_decay
    if state.optimizer == "sgd":
        if wd == 0:
            w.add_(grad, alpha=-lr)  # one pass: w + (-lr) * g
        else:
            w.sub_((w * wd).add_(grad).mul_(lr))
    elif state.optimizer == "rowwise_adagrad":
        g = grad if wd == 0 else grad + wd * w
        momentum = state.states["momentum1"]
        m = momentum.index_select(0, rows).add_((g * g).mean(dim=1))
        momentum.index_copy_(0, rows, m)
        w.sub_((lr / (m.sqrt() + optim.eps))[:, None] * g)
    elif state.optimizer == "adam":
        bc1, bc2 = adam_bias_corrections(optim, state.step)
        m1_all, m2_all = state.states["momentum1"], state.states["momentum2"]
        m1 = m1_all.index_select(0, rows).mul_(optim.beta1).add_((1 - optim.beta1) * grad)
        m2 = m2_all.index_select(0, rows).mul_(optim.beta2).add_((1 - optim.beta2) * grad * grad)
        m1_all.index_copy_(0, rows, m1)
        m2_all.index_copy_(0, rows, m2)
        w.sub_(lr * ((m1 / bc1) / ((m2 / bc2).sqrt() + optim.eps) + wd * w))
    else:
        raise ValueError(f"unknown sparse optimizer {state.optimizer!r}")
    if low:
        w = stochastic_round(w, weight.dtype, seed, rows)
    weight.index_copy_(0, rows, w)
