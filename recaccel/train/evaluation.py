"""Evaluation of a model over a reader: logits collected, metrics computed exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from recaccel.metrics import binary_auc, binary_logloss, calibration, normalized_entropy
from recaccel.sparse import Batch


def predict(model: Callable[[Batch], Tensor], batches: Iterable[Batch]) -> tuple[Tensor, Tensor]:
    """Logits [N] and labels [N] over all batches, on the CPU."""
    logits, labels, _ = predict_rows(model, batches)
    return logits, labels


@torch.no_grad()
def predict_rows(
    model: Callable[[Batch], Tensor], batches: Iterable[Batch]
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Logits [N], labels [N] and sample weights [N] (None when a batch has none) over all
    batches, in their order, on the CPU."""
    logits, labels, weights = [], [], []
    for batch in batches:
        logits.append(model(batch).float().cpu())
        labels.append(batch.labels.float().cpu())
        weights.append(None if batch.weights is None else batch.weights.float().cpu())
    if not logits:
        return torch.empty(0), torch.empty(0), None
    weight = None if any(w is None for w in weights) else torch.cat(weights)
    return torch.cat(logits), torch.cat(labels), weight


def binary_metrics(logits: Tensor, labels: Tensor) -> dict[str, float]:
    """AUC, logloss, normalized entropy (NE), calibration and CTR of click predictions (unweighted,
    as the logloss and CTR beside them)."""
    probs = torch.sigmoid(logits.double())
    return {
        "auc": binary_auc(logits, labels),
        "logloss": binary_logloss(probs, labels),
        "ne": normalized_entropy(probs, labels),
        "calibration": calibration(probs, labels),
        "ctr": float(labels.double().mean()),
        "eval_rows": int(labels.numel()),
    }


def rating_metrics(preds: Tensor, labels: Tensor) -> dict[str, float]:
    """MAE and RMSE of rating predictions."""
    err = preds.double() - labels.double()
    return {
        "mae": float(err.abs().mean()),
        "rmse": float(err.pow(2).mean().sqrt()),
        "eval_rows": int(labels.numel()),
    }
