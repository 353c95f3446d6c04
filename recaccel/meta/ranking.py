"""Per-task ranking metrics of query predictions: nDCG@k and grouped AUC.

nDCG follows the usual definition with a log2 discount::

    DCG@k  = sum_{n=1..k} gain(rel_n) / log2(n + 1)      (rel_n: true label of the item ranked n)
    nDCG@k = DCG@k / IDCG@k                               (IDCG: DCG of the ideal order)

with ``gain(r) = 2^r - 1`` (``"exponential"``, the default; MeLU, Lee et al. KDD 2019,
reports nDCG@k of each user's query items ranked by predicted rating, averaged over
users) or ``gain(r) = r`` (``"linear"``, scikit-learn's ``ndcg_score``). Items are the
task's real (unmasked) query rows ranked by prediction, descending; tied predictions keep
row order. When a task has fewer than k real rows, k is cut to their number. A task with
no real rows or with IDCG = 0 (no relevant item) has no nDCG and is left out of means.

Shapes: T tasks, Q query rows per task.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recaccel.metrics import binary_auc

GAINS = ("exponential", "linear")


def _gain(relevance: Tensor, gain: str) -> Tensor:
    if gain == "exponential":
        return torch.pow(2.0, relevance) - 1.0
    if gain == "linear":
        return relevance
    raise ValueError(f"nDCG gain must be one of {GAINS}, got {gain!r}")


def ndcg_per_task(
    scores: Tensor, relevance: Tensor, mask: Tensor, k: int, gain: str = "exponential"
) -> Tensor:
    """nDCG@k of every task's real query rows (see the module doc).

    Args:
        scores: [T, Q] predictions.
        relevance: [T, Q] non-negative true labels or ratings.
        mask: [T, Q], 1 for a real row.
        k: cut-off, >= 1.
        gain: ``"exponential"`` (2^rel - 1) or ``"linear"`` (rel).

    Returns:
        float64 [T], NaN for tasks without an nDCG.
    """
    if k < 1:
        raise ValueError(f"nDCG cut-off k must be >= 1, got {k}")
    scores, relevance = scores.detach().double().cpu(), relevance.detach().double().cpu()
    real = mask.detach().cpu() > 0
    # Padded rows sort last and carry no gain.
    gains = torch.where(real, _gain(relevance, gain), torch.zeros_like(relevance))
    order = torch.sort(
        torch.where(real, scores, torch.full_like(scores, -math.inf)), dim=1, descending=True, stable=True
    ).indices
    ranked = gains.gather(1, order)[:, :k]
    ideal = torch.sort(gains, dim=1, descending=True).values[:, :k]
    discount = 1.0 / torch.log2(torch.arange(2, ranked.shape[1] + 2, dtype=torch.float64))
    dcg, idcg = (ranked * discount).sum(1), (ideal * discount).sum(1)
    ok = (idcg > 0) & real.any(1)
    return torch.where(ok, dcg / torch.where(ok, idcg, torch.ones_like(idcg)), torch.full_like(dcg, math.nan))


def auc_per_task(scores: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Exact ROC AUC of each task's real query rows; float64 [T], NaN for one-class tasks."""
    scores, labels, real = scores.detach().cpu(), labels.detach().cpu(), mask.detach().cpu() > 0
    out = torch.full((scores.shape[0],), math.nan, dtype=torch.float64)
    for t in range(scores.shape[0]):
        out[t] = binary_auc(scores[t][real[t]], labels[t][real[t]])
    return out
