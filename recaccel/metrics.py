"""Exact evaluation metrics shared by the data generators and the trainer.

All functions take 1-D tensors of N scores and N labels.
"""

from __future__ import annotations

import torch
from torch import Tensor


def binary_auc(scores: Tensor, labels: Tensor, weights: Tensor | None = None) -> float:
    """Exact ROC AUC, ties counted as one half (the Mann-Whitney statistic).

    Equals ``sklearn.metrics.roc_auc_score`` including on tied scores. Returns NaN when
    only one class is present.

    Args:
        scores: [N] real scores (logits or probabilities; only their order matters).
        labels: [N] in {0, 1}.
        weights: optional [N] non-negative sample weights.
    """
    scores = scores.detach().double().flatten().cpu()
    labels = labels.detach().double().flatten().cpu()
    w = torch.ones_like(scores) if weights is None else weights.detach().double().flatten().cpu()
    order = torch.argsort(scores)
    s, y, w = scores[order], labels[order], w[order]
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


def binary_logloss(probs: Tensor, labels: Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities [N] against labels [N] in {0, 1}."""
    p = probs.detach().double().clamp(eps, 1 - eps)
    y = labels.detach().double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
