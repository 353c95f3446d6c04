"""Per-task ranking metrics of query predictions: nDCG@k and grouped AUC.

nDCG follows the usual definition with a log2 discount::

    DCG@k  = sum_{n=1..k} gain(rel_n) / log2(n + 1)      (rel_n: true label of the item ranked n)
    nDCG@k = DCG@k / IDCG@k                               (IDCG: DCG of the ideal order)

with ``gain(r) = 2^r - 1`` (``"exponential"``, the default; MeLU, Lee et al. KDD 2019,
reports nDCG@k of each user's query items ranked by predicted rating, averaged over
users) or ``gain(r) = r`` (``"linear"``, scikit-learn's ``ndcg_score``). Items are the
task's real (unmasked) query rows ranked by prediction, descending. Tied predictions
share their ranks: each item of a tie group gets the group's mean gain (the DCG averaged
over every order of the ties, McSherry & Najork 2008, as scikit-learn does), so the
result never depends on row order. When a task has fewer than k real rows, k is cut to
their number. A task with no real rows, with IDCG = 0 (no relevant item), or with a
negative relevance (real-valued regression targets: the gain is undefined, and
scikit-learn refuses them) has no nDCG and is left out of means.

Inputs are checked on real rows only (padded rows may hold anything): a NaN or infinite
prediction or relevance (an AUC label not 0 or 1) raises
:class:`~recaccel.metrics.MetricError`, a one-line RecaccelError.

Shapes: T tasks, Q query rows per task.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recaccel.metrics import MetricError, auc_of_valid, check_finite

GAINS = ("exponential", "linear")


def _gain(relevance: Tensor, gain: str) -> Tensor:
    if gain == "exponential":
        return torch.pow(2.0, relevance) - 1.0
    if gain == "linear":
        return relevance
    raise MetricError(f"nDCG gain must be one of {GAINS}, got {gain!r}")


def _real_rows(scores: Tensor, labels: Tensor, mask: Tensor, fn: str) -> tuple[Tensor, Tensor, Tensor]:
    """float64 CPU scores and labels [T, Q] and the bool mask of real rows, scores checked."""
    if not scores.shape == labels.shape == mask.shape or scores.dim() != 2:
        raise MetricError(
            f"{fn}: scores {tuple(scores.shape)}, labels {tuple(labels.shape)} and mask "
            f"{tuple(mask.shape)} must be equal [T, Q] shapes"
        )
    scores, labels = scores.detach().double().cpu(), labels.detach().double().cpu()
    real = mask.detach().cpu() > 0
    check_finite(scores[real], f"{fn}: predictions of real rows")
    check_finite(labels[real], f"{fn}: labels of real rows")
    return scores, labels, real


def _check_labels(labels: Tensor, ok: Tensor, fn: str, rule: str) -> None:
    bad = ~ok
    if bool(bad.any()):
        t, q = (int(i) for i in bad.nonzero()[0])
        raise MetricError(
            f"{fn}: labels of real rows must be {rule}: {int(bad.sum())} are not "
            f"(first at task {t}, row {q}: {float(labels[t, q])})"
        )


def _tie_averaged_dcg(scores: Tensor, gains: Tensor, discount: Tensor) -> Tensor:
    """DCG [T] of gains ranked by scores, descending, ties sharing their mean gain.

    Args:
        scores: [T, Q] float64, padded rows at -inf (one tie group of zero gain, last).
        gains: [T, Q] float64.
        discount: [Q] float64, 0 from the cut-off on.
    """
    s, order = torch.sort(scores, dim=1, descending=True)
    g = gains.gather(1, order)
    new_group = torch.ones_like(s, dtype=torch.bool)
    new_group[:, 1:] = s[:, 1:] != s[:, :-1]
    group = torch.cumsum(new_group.long(), 1) - 1  # [T, Q], ids < Q
    zeros = torch.zeros_like(s)
    gain_sum = zeros.scatter_add(1, group, g)
    count = zeros.scatter_add(1, group, torch.ones_like(s))
    discount_sum = zeros.scatter_add(1, group, discount.expand_as(s))
    mean_gain = gain_sum / count.clamp(min=1)  # unused group ids have count 0 and gain 0
    return (mean_gain * discount_sum).sum(1)


def ndcg_per_task(
    scores: Tensor, relevance: Tensor, mask: Tensor, k: int, gain: str = "exponential"
) -> Tensor:
    """nDCG@k of every task's real query rows (see the module doc).

    Args:
        scores: [T, Q] predictions, finite on real rows.
        relevance: [T, Q] true labels or ratings, finite on real rows; a task with a
            negative one gets NaN.
        mask: [T, Q], 1 for a real row.
        k: cut-off, >= 1.
        gain: ``"exponential"`` (2^rel - 1) or ``"linear"`` (rel).

    Returns:
        float64 [T], NaN for tasks without an nDCG.

    Raises:
        MetricError: bad k, gain, shapes, or values of real rows (see the module doc).
    """
    fn = "ndcg"
    if k < 1:
        raise MetricError(f"nDCG cut-off k must be >= 1, got {k}")
    scores, relevance, real = _real_rows(scores, relevance, mask, fn)
    undefined = (real & (relevance < 0)).any(1)
    relevance = torch.where(real, relevance.clamp_min(0), torch.zeros_like(relevance))
    # Padded rows sort last (their -inf is no real score) and carry no gain.
    gains = torch.where(real, _gain(relevance, gain), torch.zeros_like(relevance))
    ranked_scores = torch.where(real, scores, torch.full_like(scores, -math.inf))
    q = scores.shape[1]
    discount = 1.0 / torch.log2(torch.arange(2, q + 2, dtype=torch.float64))
    discount[k:] = 0.0
    dcg = _tie_averaged_dcg(ranked_scores, gains, discount)
    idcg = (torch.sort(gains, dim=1, descending=True).values * discount).sum(1)
    ok = (idcg > 0) & real.any(1) & ~undefined
    return torch.where(ok, dcg / torch.where(ok, idcg, torch.ones_like(idcg)), torch.full_like(dcg, math.nan))


def auc_per_task(scores: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Exact ROC AUC of each task's real query rows; float64 [T].

    One-class tasks (common for short query sets) give NaN without a warning: grouped AUC
    leaves them out by design.

    Raises:
        MetricError: bad shapes, a non-finite prediction or a label not 0 or 1 on a real row.
    """
    fn = "gauc"
    scores, labels, real = _real_rows(scores, labels, mask, fn)
    _check_labels(labels, ~real | (labels == 0) | (labels == 1), fn, "0 or 1")
    out = torch.full((scores.shape[0],), math.nan, dtype=torch.float64)
    for t in range(scores.shape[0]):
        s, y = scores[t][real[t]], labels[t][real[t]]
        out[t] = auc_of_valid(s, y, torch.ones_like(s))
    return out
