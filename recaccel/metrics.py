"""Exact evaluation metrics shared by the data generators and the trainer.

All functions take 1-D tensors of N scores and N labels. Inputs are checked before
anything is computed: a non-finite score or probability, a label outside its range, a
negative weight or mismatched lengths raise :class:`MetricError` (a
:class:`~recaccel.errors.RecaccelError`, so the CLI prints it as one line). A metric that
is undefined for valid input (AUC or NE of a single class, calibration without positives,
no rows) is NaN with an :class:`UndefinedMetricWarning`.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from recaccel.errors import RecaccelError


class MetricError(RecaccelError, ValueError):
    """A metric got NaN/inf predictions, out-of-range labels or mismatched inputs."""


class UndefinedMetricWarning(UserWarning):
    """A metric is undefined for its (valid) input and was returned as NaN."""


def check_finite(values: Tensor, what: str, hint: str = "") -> None:
    """Raises MetricError naming how many of ``values`` are NaN or infinite, and the first.

    Args:
        values: any shape; indices in the message are into its flattened form.
        what: what the values are, the start of the message.
        hint: appended to the message after ``"; "`` when given.
    """
    bad = ~torch.isfinite(values.detach().flatten())
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        value = float(values.detach().flatten()[first])
        tail = f"; {hint}" if hint else ""
        raise MetricError(
            f"{what}: {int(bad.sum())} of {bad.numel()} values are NaN or infinite "
            f"(first at index {first}: {value}){tail}"
        )


def _check_range(values: Tensor, ok: Tensor, what: str, rule: str) -> None:
    """Raises MetricError when some ``ok`` entry is False (``values`` already finite-checked)."""
    bad = ~ok
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        raise MetricError(
            f"{what} must be {rule}: {int(bad.sum())} of {bad.numel()} are not "
            f"(first at index {first}: {float(values[first])})"
        )


def _as_double(name: str, x: Tensor, n: int | None, fn: str) -> Tensor:
    x = x.detach().double().flatten().cpu()
    if n is not None and x.numel() != n:
        raise MetricError(f"{fn}: {name} has {x.numel()} values, scores/probs have {n}")
    return x


def _labels(labels: Tensor, n: int, fn: str, *, binary: bool) -> Tensor:
    y = _as_double("labels", labels, n, fn)
    check_finite(y, f"{fn}: labels")
    if binary:
        _check_range(y, (y == 0) | (y == 1), f"{fn}: labels", "0 or 1")
    else:
        _check_range(y, (y >= 0) & (y <= 1), f"{fn}: labels", "in [0, 1]")
    return y


def _weights(weights: Tensor | None, n: int, fn: str) -> Tensor:
    if weights is None:
        return torch.ones(n, dtype=torch.float64)
    w = _as_double("weights", weights, n, fn)
    check_finite(w, f"{fn}: weights")
    _check_range(w, w >= 0, f"{fn}: weights", ">= 0")
    return w


def _undefined(fn: str, why: str) -> float:
    warnings.warn(f"{fn}: {why}; returning NaN", UndefinedMetricWarning, stacklevel=3)
    return float("nan")


def auc_of_valid(scores: Tensor, labels: Tensor, weights: Tensor) -> float:
    """Exact weighted AUC of already checked float64 [N] inputs; NaN (silently) for one class.

    For callers that validate once and then take the AUC of many subsets (per-task AUC),
    where a single-class subset is expected and not worth a warning.
    """
    order = torch.argsort(scores)
    s, y, w = scores[order], labels[order], weights[order]
    pos_w, neg_w = w * y, w * (1 - y)
    total_pos, total_neg = float(pos_w.sum()), float(neg_w.sum())
    if total_pos == 0 or total_neg == 0:
        return float("nan")
    # Group tied scores: each positive beats the negatives strictly below its tie group
    # and half of the negatives inside it.
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    groups = counts.numel()
    neg_in_group = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, neg_w)
    pos_in_group = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, pos_w)
    neg_below = torch.cumsum(neg_in_group, 0) - neg_in_group
    wins = (pos_in_group * (neg_below + 0.5 * neg_in_group)).sum()
    return float(wins / (total_pos * total_neg))


def binary_auc(scores: Tensor, labels: Tensor, weights: Tensor | None = None) -> float:
    """Exact ROC AUC, ties counted as one half (the Mann-Whitney statistic).

    Equals ``sklearn.metrics.roc_auc_score`` including on tied scores and with weights.

    Args:
        scores: [N] real scores (logits or probabilities; only their order matters).
        labels: [N] in {0, 1}.
        weights: optional [N] non-negative sample weights.

    Returns:
        The AUC; NaN with an :class:`UndefinedMetricWarning` when there are no rows or only
        one class (by weight: a class whose weights sum to 0 counts as absent).

    Raises:
        MetricError: a score, label or weight is NaN or infinite, a label is not 0 or 1,
            a weight is negative, or the lengths differ.
    """
    fn = "binary_auc"
    s = _as_double("scores", scores, None, fn)
    check_finite(s, f"{fn}: scores")
    y = _labels(labels, s.numel(), fn, binary=True)
    w = _weights(weights, s.numel(), fn)
    if s.numel() == 0:
        return _undefined(fn, "no rows")
    pos, neg = float((w * y).sum()), float((w * (1 - y)).sum())
    if pos == 0 or neg == 0:
        present = "positives" if pos > 0 else "negatives"
        return _undefined(fn, f"only {present} among {s.numel()} rows, AUC is undefined")
    return auc_of_valid(s, y, w)


def _checked_probs(probs: Tensor, labels: Tensor, weights: Tensor | None, fn: str) -> tuple[Tensor, ...]:
    """Float64 probabilities, labels (soft allowed) and weights, checked for ``fn``."""
    p = _as_double("probs", probs, None, fn)
    check_finite(p, f"{fn}: probs")
    _check_range(p, (p >= 0) & (p <= 1), f"{fn}: probs", "in [0, 1]")
    y = _labels(labels, p.numel(), fn, binary=False)
    w = _weights(weights, p.numel(), fn)
    return p, y, w


def _mean_logloss(p: Tensor, y: Tensor, w: Tensor, eps: float) -> float:
    """Weighted mean cross-entropy of checked inputs whose weights sum to more than 0."""
    p = p.clamp(eps, 1 - eps)
    return float(-(w * (y * p.log() + (1 - y) * (1 - p).log())).sum() / w.sum())


def binary_logloss(probs: Tensor, labels: Tensor, eps: float = 1e-7, weights: Tensor | None = None) -> float:
    """Mean binary cross-entropy, probabilities clamped to ``[eps, 1 - eps]``.

    Equals ``sklearn.metrics.log_loss`` (with ``labels=[0, 1]``) wherever the
    probabilities lie inside the clamp; defined for a single class too.

    Args:
        probs: [N] probabilities in [0, 1].
        labels: [N] in [0, 1] (soft labels allowed).
        eps: clamp that keeps the loss finite at probabilities 0 and 1.
        weights: optional [N] non-negative sample weights (a weighted mean).

    Returns:
        The loss; NaN with an :class:`UndefinedMetricWarning` when there are no rows or
        the weights sum to 0.

    Raises:
        MetricError: a probability, label or weight is NaN or infinite, a probability or
            label lies outside [0, 1], a weight is negative, or the lengths differ.
    """
    fn = "binary_logloss"
    p, y, w = _checked_probs(probs, labels, weights, fn)
    if float(w.sum()) == 0:
        return _undefined(fn, "no rows" if p.numel() == 0 else "weights sum to 0")
    return _mean_logloss(p, y, w, eps)


def normalized_entropy(
    probs: Tensor, labels: Tensor, eps: float = 1e-7, weights: Tensor | None = None
) -> float:
    """Normalized entropy (NE): logloss over the entropy of the base rate of ``labels``.

    NE = logloss / H(p), where p is the (weighted) mean label and
    H(p) = -(p log p + (1 - p) log(1 - p)), the logloss of always predicting p (He et al.
    2014, "Practical lessons from predicting clicks on ads at Facebook"). Below 1 the model
    beats predicting the base rate; lower is better. The logloss is :func:`binary_logloss`'s
    (same clamp), so NE does not depend on the base rate the way logloss does.

    Args:
        probs: [N] probabilities in [0, 1].
        labels: [N] in [0, 1] (soft labels allowed).
        eps: clamp of the probabilities in the logloss.
        weights: optional [N] non-negative sample weights (in the logloss and in p).

    Returns:
        NE; NaN with an :class:`UndefinedMetricWarning` when there are no rows, the weights
        sum to 0, or p is 0 or 1 (a single class: the entropy is 0).

    Raises:
        MetricError: as :func:`binary_logloss`.
    """
    fn = "normalized_entropy"
    p, y, w = _checked_probs(probs, labels, weights, fn)
    total = float(w.sum())
    if total == 0:
        return _undefined(fn, "no rows" if p.numel() == 0 else "weights sum to 0")
    rate = float((w * y).sum()) / total
    if rate <= 0 or rate >= 1:
        return _undefined(fn, f"the base rate of the labels is {rate:g}, its entropy is 0")
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return _mean_logloss(p, y, w, eps) / entropy


def calibration(probs: Tensor, labels: Tensor, weights: Tensor | None = None) -> float:
    """Predicted over actual CTR: the (weighted) sum of probabilities over that of labels.

    1 is calibrated; above 1 the model over-predicts clicks, below 1 it under-predicts.

    Args:
        probs: [N] probabilities in [0, 1].
        labels: [N] in [0, 1] (soft labels allowed).
        weights: optional [N] non-negative sample weights.

    Returns:
        The ratio; NaN with an :class:`UndefinedMetricWarning` when the labels (by weight)
        sum to 0: no rows or no positives.

    Raises:
        MetricError: as :func:`binary_logloss`.
    """
    fn = "calibration"
    p, y, w = _checked_probs(probs, labels, weights, fn)
    actual = float((w * y).sum())
    if actual == 0:
        return _undefined(fn, "no rows" if p.numel() == 0 else "no positive labels (by weight)")
    return float((w * p).sum()) / actual
