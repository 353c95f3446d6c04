"""Evaluation of a model over a reader: click metrics streamed batch by batch in bounded
memory (:class:`~recaccel.metrics.StreamingBinaryMetrics`), or logits collected where every
row is needed (rating metrics, ``--predictions``), metrics computed exactly."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from recaccel.metrics import (
    StreamingBinaryMetrics,
    UndefinedMetricWarning,
    auc_of_valid,
    binary_auc,
    binary_logloss,
    calibration,
    check_finite,
    normalized_entropy,
)
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


# Why model outputs can be NaN or infinite, appended to the one-line error.
DIVERGED_HINT = "the model has diverged (a lower optim.lr may help)"


@torch.no_grad()
def stream_binary(model: Callable[[Batch], Tensor], batches: Iterable[Batch]) -> StreamingBinaryMetrics:
    """The click metrics' accumulator over all batches (unweighted, as :func:`binary_metrics`).

    Raises:
        MetricError: a NaN or infinite logit (the model diverged).
    """
    acc = StreamingBinaryMetrics()
    for batch in batches:
        logits = model(batch).float().cpu()
        check_finite(logits, "evaluation: model predictions", DIVERGED_HINT)
        acc.update(logits, batch.labels.float().cpu())
    return acc


def gather_streaming(
    acc: StreamingBinaryMetrics, gather: Callable[[Tensor], Tensor]
) -> StreamingBinaryMetrics:
    """One accumulator of every rank's rows: each part of the state concatenated over ranks
    (``gather``) and summed; the identity in one process."""
    state = acc.state()
    bins = state["bins"].shape[0]
    merged = StreamingBinaryMetrics(max_entries=acc.max_entries, bin_bits=bins.bit_length() - 1, eps=acc.eps)
    merged.load_state(
        {
            "sums": gather(state["sums"].view(1, -1)).cpu().sum(0),
            "bins": gather(state["bins"]).cpu().view(-1, bins, 2).sum(0),
            "coarse": gather(state["coarse"].to(torch.uint8)).cpu().view(-1, bins).amax(0).bool(),
            "keys": gather(state["keys"]).cpu(),
            "weights": gather(state["weights"]).cpu(),
        }
    )
    return merged


def streamed_metrics(acc: StreamingBinaryMetrics) -> dict[str, Any]:
    """:func:`binary_metrics`' keys from an accumulator (``auc_error_bound`` too when the AUC
    is not exact); an undefined metric warns, as there."""
    out = acc.compute()
    exact, bound = out.pop("auc_exact"), out.pop("auc_error_bound")
    if not exact:
        out["auc_error_bound"] = bound
    for name in ("auc", "ne", "calibration"):
        if out[name] != out[name]:  # NaN
            warnings.warn(
                f"evaluation: {name} is undefined on these rows; NaN", UndefinedMetricWarning, stacklevel=2
            )
    return out


class MetricWindow:
    """The logits and labels of the last ``rows`` training rows (``train.metric_window``),
    kept where they were computed (no device sync per step), scored at log steps.

    Args:
        rows: the window's length in rows.
        loss: the run's loss kind: ``bce`` gives ``window_auc`` and ``window_logloss``,
            ``mse`` gives ``window_rmse``.
    """

    def __init__(self, rows: int, loss: str) -> None:
        self.rows = rows
        self.loss = loss
        self._parts: deque[tuple[Tensor, Tensor]] = deque()
        self._count = 0

    def add(self, logits: Tensor, labels: Tensor) -> None:
        """Appends a batch's rows; drops whole old batches the window no longer needs.

        Copies: a CUDA-graphed head reuses its output buffer every step."""
        self._parts.append(
            (logits.detach().float().flatten().clone(), labels.detach().float().flatten().clone())
        )
        self._count += logits.numel()
        while self._count - self._parts[0][0].numel() >= self.rows:
            self._count -= self._parts.popleft()[0].numel()

    def metrics(self) -> dict[str, float | int]:
        """The window's metrics (NaN AUC for a single class; nothing before the first row)."""
        if not self._parts:
            return {}
        logits = torch.cat([p[0] for p in self._parts])[-self.rows :].double().cpu()
        labels = torch.cat([p[1] for p in self._parts])[-self.rows :].double().cpu()
        if self.loss != "bce":
            return {
                "window_rmse": float((logits - labels).pow(2).mean().sqrt()),
                "window_rows": logits.numel(),
            }
        probs = torch.sigmoid(logits).clamp(1e-7, 1 - 1e-7)
        logloss = -(labels * probs.log() + (1 - labels) * (1 - probs).log()).mean()
        auc = auc_of_valid(logits, labels, torch.ones_like(labels))
        return {"window_auc": auc, "window_logloss": float(logloss), "window_rows": logits.numel()}
