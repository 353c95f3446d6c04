"""Sparse optimizers of a packed buffer: their state and the reference update rules.

The rules are documented on :class:`~recaccel.ops.embedding.specs.SparseOptimConfig`;
this module is their executable definition, which the Triton fused kernel and FBGEMM are
tested against.

Shapes: R packed rows, D dim, U unique rows touched by a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.ops.embedding.specs import OPTIMIZER_STATES, SparseOptimConfig


@dataclass
class PackState:
    """The tensors of one pack that an update touches.

    Attributes:
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``.
        weight: float32 [R, D] packed rows (updated in place).
        states: Optimizer state by name: ``momentum1`` [R] (row-wise Adagrad) or
            ``momentum1``/``momentum2`` [R, D] (Adam).
        step: int64 scalar CPU tensor, the pack's update count (Adam's ``t``); a CPU
            tensor so that reading it never waits for the GPU.
    """

    optimizer: str
    weight: Tensor
    states: dict[str, Tensor]
    step: Tensor


def init_states(optimizer: str, num_rows: int, dim: int, device: torch.device) -> dict[str, Tensor]:
    """Zero optimizer state for a pack of ``num_rows`` x ``dim``."""
    return {
        name: torch.zeros((num_rows,) if rowwise else (num_rows, dim), dtype=torch.float32, device=device)
        for name, rowwise in OPTIMIZER_STATES[optimizer]
    }


def adam_bias_corrections(config: SparseOptimConfig, step: int) -> tuple[float, float]:
    """``(1 - beta1^t, 1 - beta2^t)`` for Adam's step ``t`` (computed in float64)."""
    return 1.0 - config.beta1**step, 1.0 - config.beta2**step


@torch.no_grad()
def reference_update(state: PackState, config: SparseOptimConfig, rows: Tensor, grad: Tensor) -> None:
    """Applies one sparse optimizer step to the touched rows, in place.

    Args:
        state: The pack's weight, optimizer state and step (all updated in place).
        config: Hyper-parameters.
        rows: int64 [U] unique packed rows.
        grad: float32 [U, D] summed gradient of each row.
    """
    state.step.add_(1)
    w = state.weight[rows]
    lr, wd = config.lr, config.weight_decay
    if state.optimizer == "sgd":
        state.weight[rows] = w - lr * (grad + wd * w)
    elif state.optimizer == "rowwise_adagrad":
        g = grad + wd * w
        m = state.states["momentum1"][rows] + (g * g).mean(dim=1)
        state.states["momentum1"][rows] = m
        state.weight[rows] = w - (lr / (m.sqrt() + config.eps))[:, None] * g
    elif state.optimizer == "adam":
        bc1, bc2 = adam_bias_corrections(config, int(state.step))
        m1 = config.beta1 * state.states["momentum1"][rows] + (1 - config.beta1) * grad
        m2 = config.beta2 * state.states["momentum2"][rows] + (1 - config.beta2) * grad * grad
        state.states["momentum1"][rows] = m1
        state.states["momentum2"][rows] = m2
        state.weight[rows] = w - lr * ((m1 / bc1) / ((m2 / bc2).sqrt() + config.eps) + wd * w)
    else:
        raise ValueError(f"unknown sparse optimizer {state.optimizer!r}")
