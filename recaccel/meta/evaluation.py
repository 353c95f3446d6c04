"""Evaluation of a meta-learned model: adapt on each task's support rows, score its query.

For every evaluation TaskBatch the learner adapts on the support rows and predicts the
query rows; the same metrics are computed for the unadapted meta-parameters, under keys
with the suffix ``_no_adapt``. Padded rows (mask 0) are excluded everywhere.

- ratings (``loss="mse"``): ``mae`` and ``rmse`` over all real query rows;
- clicks (``loss="bce"``): ``auc`` over all real query rows, ``gauc`` (per-task AUC
  averaged over the tasks that have both classes), ``logloss``, ``ne`` and ``calibration``;
- both: ``ndcg@k`` of each task's query ranking averaged over tasks (see
  :mod:`recaccel.meta.ranking` for the exact definition and which tasks count).

Counts: ``tasks`` (with real query rows), ``query_rows``, ``gauc_tasks``, ``ndcg_tasks``.

Shapes: T tasks, Q query rows per task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from recaccel.config import Loss
from recaccel.meta.functional import LOSSES
from recaccel.meta.learner import MetaLearner
from recaccel.meta.ranking import auc_per_task, ndcg_per_task
from recaccel.metrics import binary_auc, binary_logloss, calibration, check_finite, normalized_entropy
from recaccel.sparse import TaskBatch

_DIVERGED = "the model has diverged (a lower optim.lr or meta.inner_lr may help)"


def _nanmean(values: list[Tensor]) -> tuple[float, int]:
    if not values:
        return math.nan, 0
    v = torch.cat(values)
    v = v[~torch.isnan(v)]
    return (float(v.mean()) if v.numel() else math.nan), int(v.numel())


class TaskMetrics:
    """Accumulates query predictions of many TaskBatches and computes the metrics.

    Args:
        loss: ``"mse"`` (ratings) or ``"bce"`` (clicks; predictions are logits).
        ks: nDCG cut-offs.
        gain: nDCG gain, ``"exponential"`` or ``"linear"``.
    """

    def __init__(self, loss: Loss, ks: Sequence[int] = (1, 3), gain: str = "exponential") -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        self.loss, self.ks, self.gain = loss, tuple(ks), gain
        self._pred: list[Tensor] = []
        self._label: list[Tensor] = []
        self._ndcg: dict[int, list[Tensor]] = {k: [] for k in self.ks}
        self._auc: list[Tensor] = []
        self._tasks = 0

    def update(self, pred: Tensor, labels: Tensor, mask: Tensor) -> None:
        """Adds T tasks: predictions, labels and mask, each [T, Q]."""
        if not pred.shape == labels.shape == mask.shape:
            raise ValueError(
                f"pred {tuple(pred.shape)}, labels {tuple(labels.shape)}, mask {tuple(mask.shape)} differ"
            )
        pred, labels, mask = pred.detach().cpu().double(), labels.detach().cpu().double(), mask.detach().cpu()
        real = mask > 0
        self._pred.append(pred[real])
        self._label.append(labels[real])
        self._tasks += int(real.any(1).sum())
        for k in self.ks:
            self._ndcg[k].append(ndcg_per_task(pred, labels, mask, k, self.gain))
        if self.loss == "bce":
            self._auc.append(auc_per_task(pred, labels, mask))

    def compute(self) -> dict[str, float]:
        """The metrics so far (NaN where undefined, e.g. no rows)."""
        pred = torch.cat(self._pred) if self._pred else torch.empty(0, dtype=torch.float64)
        label = torch.cat(self._label) if self._label else torch.empty(0, dtype=torch.float64)
        out: dict[str, float] = {"tasks": float(self._tasks), "query_rows": float(pred.numel())}
        empty = pred.numel() == 0
        if self.loss == "mse":
            err = pred - label
            out["mae"] = math.nan if empty else float(err.abs().mean())
            out["rmse"] = math.nan if empty else float(err.square().mean().sqrt())
        else:
            out["auc"] = math.nan if empty else binary_auc(pred, label)
            out["logloss"] = math.nan if empty else binary_logloss(torch.sigmoid(pred), label)
            out["ne"] = math.nan if empty else normalized_entropy(torch.sigmoid(pred), label)
            out["calibration"] = math.nan if empty else calibration(torch.sigmoid(pred), label)
            out["gauc"], gauc_tasks = _nanmean(self._auc)
            out["gauc_tasks"] = float(gauc_tasks)
        for k in self.ks:
            out[f"ndcg@{k}"], count = _nanmean(self._ndcg[k])
            out["ndcg_tasks"] = float(count)
        return out


@torch.no_grad()
def evaluate_meta(
    learner: MetaLearner,
    batches: Iterable[TaskBatch],
    *,
    ks: Sequence[int] = (1, 3),
    gain: str = "exponential",
    device: torch.device | str | None = None,
    record: Callable[[TaskBatch, Tensor, Tensor], None] | None = None,
) -> dict[str, float]:
    """Adapts on support and scores the query of every task of ``batches``.

    Args:
        learner: the meta-learned model (its loss picks rating or click metrics).
        batches: evaluation TaskBatches.
        ks: nDCG cut-offs.
        gain: nDCG gain (see :mod:`recaccel.meta.ranking`).
        device: moves each batch there first when given.
        record: called with each batch and its ``(adapted, unadapted)`` query predictions
            [T, Q] (e.g. to write them out).

    Returns:
        Metrics after adaptation, and the same with the suffix ``_no_adapt``.

    Raises:
        MetricError: a real query row's prediction is NaN or infinite, or its label is out
            of range (a one-line RecaccelError).
    """
    adapted = TaskMetrics(learner.loss, ks, gain)
    base = TaskMetrics(learner.loss, ks, gain)
    was_training = learner.training
    learner.eval()
    try:
        for tb in batches:
            if device is not None:
                tb = tb.to(device)
            pred, pred0 = learner.predict(tb)
            real = tb.query_mask > 0
            check_finite(pred[real], "meta evaluation: query predictions after adaptation", _DIVERGED)
            check_finite(pred0[real], "meta evaluation: query predictions without adaptation", _DIVERGED)
            labels = tb.query.labels.view(tb.num_tasks, tb.query_size)
            adapted.update(pred, labels, tb.query_mask)
            base.update(pred0, labels, tb.query_mask)
            if record is not None:
                record(tb, pred, pred0)
    finally:
        learner.train(was_training)
    out = adapted.compute()
    out.update({f"{k}_no_adapt": v for k, v in base.compute().items() if k not in ("tasks", "query_rows")})
    return out
