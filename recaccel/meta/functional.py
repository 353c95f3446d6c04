"""Functional building blocks of the meta step: masked task losses and batched MLPs.

The inner loop adapts a copy of some head parameters per task. Stacked along a
leading task axis ([T, out, in] weights), a per-task MLP is a chain of batched matmuls
(``baddbmm``), one launch per layer for all T tasks.

Shapes: T tasks, N rows per task (S support or Q query), K input features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recaccel.config import Loss, choices

LOSSES = choices(Loss)


def elementwise_loss(pred: Tensor, labels: Tensor, loss: Loss) -> Tensor:
    """Per-row loss: BCE with logits (``"bce"``, binary labels) or squared error (``"mse"``)."""
    if loss == "bce":
        return F.binary_cross_entropy_with_logits(pred, labels, reduction="none")
    if loss == "mse":
        return (pred - labels).square()
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def masked_task_losses(pred: Tensor, labels: Tensor, mask: Tensor, loss: Loss) -> Tensor:
    """Mean loss of each task over its real rows: ``sum(mask*l) / max(sum(mask), 1)``.

    Works with or without the leading task axis (under ``vmap`` it is absent).

    Args:
        pred: [T, N] logits or ratings.
        labels: [T, N].
        mask: [T, N], 1 for a real row, 0 for padding.
        loss: ``"bce"`` or ``"mse"``.

    Returns:
        [T] losses (a task without real rows has loss 0).
    """
    per_row = elementwise_loss(pred, labels, loss)
    # where() rather than a product alone: a padded row's loss may be inf.
    per_row = torch.where(mask > 0, per_row * mask, torch.zeros_like(per_row))
    return per_row.sum(-1) / mask.sum(-1).clamp_min(1.0)


def mean_over_tasks(task_losses: Tensor, mask: Tensor) -> Tensor:
    """Mean of [T] task losses over the tasks with at least one real row in ``mask`` [T, N]."""
    present = (mask.sum(-1) > 0).to(task_losses.dtype)
    return (task_losses * present).sum() / present.sum().clamp_min(1.0)


@dataclass(frozen=True)
class LinearLayer:
    """One ``nn.Linear`` of an MLP, by parameter name relative to the model.

    Attributes:
        weight: name of the [out, in] weight.
        bias: name of the [out] bias.
        relu: a ReLU follows the layer.
    """

    weight: str
    bias: str
    relu: bool


def mlp_layers(arch: nn.Module, prefix: str) -> list[LinearLayer]:
    """The layers of an arch that is an MLP of ``nn.Linear`` and ``nn.ReLU``.

    The arch is an ``nn.Sequential`` or holds one as ``arch.model`` (recaccel's
    DenseArch and OverArch). A parameter-free arch (an identity) has no layers.

    Args:
        arch: the module.
        prefix: its name in the model, e.g. ``"over_arch"``.

    Raises:
        TypeError: the arch is not (and holds no) ``nn.Sequential``.
        ValueError: the arch holds anything but Linear (with bias) and ReLU layers.
    """
    if not any(True for _ in arch.parameters()):
        return []
    seq, seq_prefix = (arch.model, f"{prefix}.model") if hasattr(arch, "model") else (arch, prefix)
    if not isinstance(seq, nn.Sequential):
        raise TypeError(
            f"{prefix}: the batched meta engine needs an nn.Sequential of Linear and ReLU layers, "
            f"got {type(seq).__name__}; use engine='vmap' for other heads"
        )
    layers: list[LinearLayer] = []
    for name, module in seq.named_children():
        if isinstance(module, nn.Linear) and module.bias is not None:
            layers.append(LinearLayer(f"{seq_prefix}.{name}.weight", f"{seq_prefix}.{name}.bias", False))
        elif isinstance(module, nn.ReLU) and layers and not layers[-1].relu:
            layers[-1] = LinearLayer(layers[-1].weight, layers[-1].bias, True)
        else:
            raise ValueError(
                f"{prefix}: the batched meta engine supports Linear (with bias) layers each followed by at "
                f"most one ReLU, got {type(module).__name__} at {seq_prefix}.{name}; use engine='vmap'"
            )
    return layers


def batched_mlp(x: Tensor, layers: list[LinearLayer], params: dict[str, Tensor]) -> Tensor:
    """Applies T per-task MLPs to T row blocks, one batched matmul per layer.

    Args:
        x: [T, N, K].
        layers: from :func:`mlp_layers`.
        params: per-task weights [T, out, in] and biases [T, out] by name (an
            ``expand`` of shared parameters is fine: it is never copied).

    Returns:
        [T, N, out of the last layer] (``x`` itself when there are no layers).
    """
    for layer in layers:
        weight, bias = params[layer.weight], params[layer.bias]
        x = torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
        if layer.relu:
            x = torch.relu(x)
    return x
