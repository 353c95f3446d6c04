"""What a training step optimizes: plain DLRM on Batches, or MAML on TaskBatches.

The :class:`~recaccel.train.trainer.Trainer` loop is the same for both; an objective
supplies the readers, the step loss and the evaluation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from recaccel.config import Config, Loss, Precision
from recaccel.errors import DataError
from recaccel.io.readers.protocol import Reader
from recaccel.io.readers.rows import BatchReader
from recaccel.metrics import check_finite
from recaccel.sparse import Batch, TaskBatch
from recaccel.train.evaluation import binary_metrics, predict, rating_metrics

# Concatenates a per-rank [N_r, ...] tensor over ranks (the process layout's ``gather``).
Gather = Callable[[Tensor], Tensor]


class Objective(Protocol):
    """The mode-specific half of training."""

    module: nn.Module  # what is optimized and checkpointed
    loss: Loss

    def reader(self, path: str, *, train: bool, rank: int, world_size: int) -> Reader: ...

    def batch_loss(self, batch: Any) -> Tensor:
        """The step loss of one batch (a mean over its rows or tasks), a scalar."""
        ...

    def evaluate(self, batches: Iterable[Any], *, gather: Gather, source: str) -> dict[str, Any]:
        """Metrics over ``batches``, this rank's part of the data at ``source``.

        Args:
            batches: this rank's evaluation batches.
            gather: concatenates a per-rank tensor over ranks, for metrics over all rows.
            source: the data's path, for messages.
        """
        ...


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    """The mixed-precision context of ``train.precision`` on ``device``.

    ``fp32``: none (the float32 path, unchanged). ``bf16``: ``torch.autocast`` to
    bfloat16, which runs the MLPs and the interaction in bfloat16 (on CUDA, and on CPU);
    the embedding lookup opts out (:class:`~recaccel.models.arches.SparseArch`), and
    parameters, gradients and the dense optimizer stay float32.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


class DLRMObjective:
    """Click (BCE) or rating (MSE) loss of a DLRM on row batches.

    Under ``train.precision = "bf16"`` the forward runs under :func:`autocast`; the
    logits are cast to float32 and the loss and metrics are computed in float32.
    """

    def __init__(self, cfg: Config, model: nn.Module, loss: Loss) -> None:
        self.cfg = cfg
        self.module = model
        self.loss = loss

    def reader(self, path: str, *, train: bool, rank: int = 0, world_size: int = 1) -> BatchReader:
        return BatchReader.from_config(path, self.cfg.data, train=train, rank=rank, world_size=world_size)

    def _forward(self, batch: Batch) -> Tensor:
        """Logits [B] of the model under the run's precision."""
        with autocast(self.cfg.train.precision, batch.labels.device):
            return self.module(batch)

    def batch_loss(self, batch: Batch) -> Tensor:
        logits = self._forward(batch).float()
        if self.loss == "bce":
            return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, weight=batch.weights)
        err = (logits - batch.labels).pow(2)
        return err.mean() if batch.weights is None else (err * batch.weights).sum() / batch.weights.sum()

    def predictions(self, batches: Iterable[Batch]) -> tuple[Tensor, Tensor]:
        """Float32 logits [N] and labels [N] (the forward under the run's precision)."""
        return predict(self._forward, batches)

    def metrics(self, logits: Tensor, labels: Tensor) -> dict[str, Any]:
        """Metrics of predictions [N]; a NaN or infinite one raises MetricError (one line)."""
        check_finite(
            logits, "evaluation: model predictions", "the model has diverged (a lower optim.lr may help)"
        )
        return binary_metrics(logits, labels) if self.loss == "bce" else rating_metrics(logits, labels)

    def evaluate(self, batches: Iterable[Batch], *, gather: Gather, source: str) -> dict[str, Any]:
        """Metrics over the predictions of all ranks (gathered: AUC is not a mean of parts).

        Raises:
            DataError: no rank had an evaluation row.
        """
        logits, labels = self.predictions(batches)
        logits, labels = gather(logits), gather(labels)
        if labels.numel() == 0:
            raise DataError(f"evaluation data {source} has no rows")
        return self.metrics(logits, labels)


class MetaObjective:
    """MAML query loss after per-task adaptation on the support rows."""

    def __init__(self, cfg: Config, model: nn.Module, loss: Loss) -> None:
        from recaccel.meta.learner import MetaLearner

        self.cfg = cfg
        self.loss = loss
        self.module = MetaLearner(model, cfg.meta, loss=loss, engine=cfg.meta.engine)

    def reader(self, path: str, *, train: bool, rank: int = 0, world_size: int = 1) -> Reader:
        from recaccel.io.readers.tasks.reader import TaskReader

        return TaskReader.from_config(
            path,
            self.cfg.tasks,
            self.cfg.data,
            train=train,
            rank=rank,
            world_size=world_size,
            query_count=self.cfg.tasks.query_count or None,
        )

    def batch_loss(self, batch: TaskBatch) -> Tensor:
        return self.module.step_loss(batch)[0]

    def evaluate(self, batches: Iterable[TaskBatch], *, gather: Gather, source: str) -> dict[str, Any]:
        """Per-task metrics; every rank evaluates whole tasks, so nothing is gathered."""
        from recaccel.meta.evaluation import evaluate_meta

        return evaluate_meta(self.module, batches)
