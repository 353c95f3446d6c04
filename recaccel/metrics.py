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


def float32_keys(scores: Tensor) -> Tensor:
    """Order-preserving int64 keys of scores rounded to float32: equal keys are equal
    float32 values (``-0.0`` and ``0.0`` included), and keys sort as the scores do."""
    s = scores.detach().cpu().float().flatten() + 0.0  # -0.0 + 0.0 is +0.0
    bits = s.view(torch.int32).long()
    # Negative floats order backwards by their bits: flip all but the sign bit.
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31


class StreamingBinaryMetrics:
    """Bounded-memory AUC, logloss, NE and calibration, updated batch by batch.

    Scores are compared as float32 (the evaluation's logits are float32). Each distinct
    score's positive and negative weight is kept in a sorted table; the table holds at most
    ``max_entries`` distinct scores. Beyond that, the score range's fine bins
    (``2**bin_bits`` of them, by the top bits of the float32 value) that hold the most
    distinct scores are coarsened: their rows count as one tie group. A fixed histogram of
    every bin's weights is always kept, so memory is at most ``17 * 2**bin_bits + 24 * (2 *
    max_entries + B)`` bytes for batches of B rows, whatever the number of rows.

    Exactness: :meth:`compute`'s ``auc`` equals :func:`binary_auc` of all the rows' float32
    scores (ties counted as one half) whenever no coarsened bin holds both classes, and
    always while the rows have at most ``max_entries`` distinct scores; ``auc_exact`` says
    which, and ``auc_error_bound`` bounds the difference otherwise (half the mixed-pair
    weight inside coarsened bins, over all positive-negative pairs). Logloss, NE,
    calibration and CTR are running float64 sums: exact up to rounding.

    Args:
        max_entries: the most distinct scores kept exactly (memory: 24 bytes each).
        bin_bits: fine bins of the score range, ``2**bin_bits`` of them (16 bytes each).
        eps: the probability clamp of the logloss, as :func:`binary_logloss`.
    """

    def __init__(self, max_entries: int = 1 << 21, bin_bits: int = 16, eps: float = 1e-7) -> None:
        if max_entries < 1 or not 1 <= bin_bits <= 24:
            raise MetricError(f"StreamingBinaryMetrics: max_entries={max_entries}, bin_bits={bin_bits}")
        self.max_entries = max_entries
        self.eps = eps
        self._shift = 32 - bin_bits
        self.bins = torch.zeros(1 << bin_bits, 2, dtype=torch.float64)  # [bin, (neg, pos)] weight
        self.coarse = torch.zeros(1 << bin_bits, dtype=torch.bool)
        self.keys = torch.empty(0, dtype=torch.int64)  # sorted, distinct
        self.weights = torch.empty(0, 2, dtype=torch.float64)  # [entry, (neg, pos)]
        self._pending: list[tuple[Tensor, Tensor]] = []
        self._pending_rows = 0
        # rows, sum w, sum w*y, sum w*p, sum w*logloss
        self.sums = torch.zeros(5, dtype=torch.float64)

    def update(self, logits: Tensor, labels: Tensor, weights: Tensor | None = None) -> None:
        """Adds a batch: ``logits`` [B] (their sigmoid is the probability), binary ``labels``
        [B], optional non-negative ``weights`` [B].

        Raises:
            MetricError: a NaN or infinite logit, label or weight, a label not 0 or 1, a
                negative weight, or mismatched lengths.
        """
        fn = "StreamingBinaryMetrics.update"
        s = _as_double("logits", logits, None, fn)
        check_finite(s, f"{fn}: logits")
        y = _labels(labels, s.numel(), fn, binary=True)
        w = _weights(weights, s.numel(), fn)
        p = torch.sigmoid(s).clamp(self.eps, 1 - self.eps)
        loss = -(y * p.log() + (1 - y) * (1 - p).log())
        torch.sigmoid(s, out=p)  # calibration uses the unclamped probability
        self.sums += torch.stack(
            [
                torch.tensor(float(s.numel()), dtype=torch.float64),
                w.sum(),
                (w * y).sum(),
                (w * p).sum(),
                (w * loss).sum(),
            ]
        )
        keys = float32_keys(logits)
        classes = torch.stack([w * (1 - y), w * y], 1)
        self.bins.index_add_(0, keys >> self._shift, classes)
        self._pending.append((keys, classes))
        self._pending_rows += keys.numel()
        if self._pending_rows >= self.max_entries:
            self._compact()

    def merge(self, other: StreamingBinaryMetrics) -> None:
        """Adds ``other``'s rows (e.g. another rank's), as if they had been updated here."""
        if other.bins.shape != self.bins.shape:
            raise MetricError("StreamingBinaryMetrics.merge: the two accumulators have different bin_bits")
        other._compact()
        self.sums += other.sums
        self.bins += other.bins
        self.coarse |= other.coarse
        self._pending.append((other.keys, other.weights))
        self._pending_rows += other.keys.numel()
        self._compact()

    def state(self) -> dict[str, Tensor]:
        """The accumulator as tensors (compacted), for gathering over ranks."""
        self._compact()
        return {
            "sums": self.sums,
            "bins": self.bins,
            "coarse": self.coarse,
            "keys": self.keys,
            "weights": self.weights,
        }

    def load_state(self, state: dict[str, Tensor]) -> None:
        """Replaces this accumulator's rows with a :meth:`state`'s (or with several states'
        tensors concatenated: keys may repeat, they are merged)."""
        self.sums, self.bins, self.coarse = state["sums"], state["bins"], state["coarse"].bool()
        self.keys = torch.empty(0, dtype=torch.int64)
        self.weights = torch.empty(0, 2, dtype=torch.float64)
        self._pending, self._pending_rows = [(state["keys"], state["weights"])], state["keys"].numel()
        self._compact()

    def memory_bytes(self) -> int:
        """Bytes held in tensors now (at most the bound in the class docstring)."""
        held = [self.bins, self.coarse, self.keys, self.weights, self.sums]
        held += [t for pair in self._pending for t in pair]
        return sum(t.numel() * t.element_size() for t in held)

    def _compact(self) -> None:
        """Merges pending rows into the sorted table of distinct scores; coarsens the fullest
        bins while the table is larger than ``max_entries``."""
        if not self._pending:
            return
        keys = torch.cat([self.keys, *(k for k, _ in self._pending)])
        weights = torch.cat([self.weights, *(w for _, w in self._pending)])
        self._pending, self._pending_rows = [], 0
        keep = ~self.coarse[keys >> self._shift]
        keys, weights = keys[keep], weights[keep]
        self.keys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        self.weights = torch.zeros(self.keys.numel(), 2, dtype=torch.float64).index_add_(0, inverse, weights)
        if self.keys.numel() > self.max_entries:
            self._coarsen()

    def _coarsen(self) -> None:
        """Coarsens the bins with the most distinct scores until the table is at most half
        full (halving leaves room, so coarsening is rare)."""
        bin_of = self.keys >> self._shift
        per_bin = torch.bincount(bin_of, minlength=self.coarse.numel())
        order = torch.argsort(per_bin, descending=True)
        removed = torch.cumsum(per_bin[order], 0)
        need = self.keys.numel() - self.max_entries // 2
        count = int(torch.searchsorted(removed, torch.tensor([need]))[0]) + 1
        self.coarse[order[:count]] = True
        keep = ~self.coarse[bin_of]
        self.keys, self.weights = self.keys[keep], self.weights[keep]

    def compute(self) -> dict[str, float | int | bool]:
        """The metrics of all rows so far.

        Returns:
            ``auc``, ``auc_exact``, ``auc_error_bound``, ``logloss``, ``ne``,
            ``calibration``, ``ctr`` (all weighted when weights were given) and
            ``eval_rows``. Undefined metrics are NaN (no rows, a single class), silently:
            the caller reports them.
        """
        self._compact()
        rows, total, pos, pred, loss = (float(v) for v in self.sums)
        nan = float("nan")
        rate = pos / total if total > 0 else nan
        entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else nan
        auc, bound = self._auc()
        return {
            "auc": auc,
            "auc_exact": bound == 0,
            "auc_error_bound": bound,
            "logloss": loss / total if total > 0 else nan,
            "ne": loss / total / entropy if total > 0 else nan,
            "calibration": pred / pos if pos > 0 else nan,
            "ctr": rate,
            "eval_rows": int(rows),
        }

    def _auc(self) -> tuple[float, float]:
        """(AUC, bound on its error): exact tie groups from the table, one group per coarse bin."""
        coarse = self.coarse.nonzero().flatten()
        keys = torch.cat([self.keys, coarse << self._shift])
        groups = torch.cat([self.weights, self.bins[coarse]])
        order = torch.argsort(keys, stable=True)
        neg, pos = groups[order, 0], groups[order, 1]
        total_neg, total_pos = float(neg.sum()), float(pos.sum())
        if total_neg == 0 or total_pos == 0:
            return float("nan"), 0.0
        neg_below = torch.cumsum(neg, 0) - neg
        pairs = total_neg * total_pos
        mixed = self.bins[coarse]
        bound = float((mixed[:, 0] * mixed[:, 1]).sum()) / 2 / pairs
        return float((pos * (neg_below + 0.5 * neg)).sum()) / pairs, bound
