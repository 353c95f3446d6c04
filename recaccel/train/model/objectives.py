"""What a training step optimizes: plain DLRM on Batches, or MAML on TaskBatches.

The :class:`~recaccel.train.loop.trainer.Trainer` loop is the same for both; an objective
supplies the readers, the step loss and the evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from recaccel.config import Config, Loss, Precision
from recaccel.errors import DataError
from recaccel.io.readers.protocol import Reader
from recaccel.io.readers.rows import BatchReader
from recaccel.metrics import check_finite
from recaccel.models.factory import places_tables_on_host
from recaccel.sparse import Batch, TaskBatch
from recaccel.train.evaluation.evaluate import (
    binary_metrics,
    gather_streaming,
    predict,
    predict_rows,
    rating_metrics,
    stream_binary,
    streamed_metrics,
)
from recaccel.train.evaluation.predictions import PredictionSink, concat_columns, row_columns, task_columns
from recaccel.train.model.head_input import embed_for_head
from recaccel.train.model.precision import matmul_precision

# Concatenates a per-rank [N_r, ...] tensor over ranks (the process layout's ``gather``).
Gather = Callable[[Tensor], Tensor]


class Objective(Protocol):
    """The mode-specific half of training."""

    module: nn.Module  # what is optimized and checkpointed
    loss: Loss
    batches_ahead: int  # batches the model wants prepared ahead (its embedding cache's lookahead)

    def reader(self, path: str, *, train: bool, rank: int, world_size: int) -> Reader: ...

    def prepare(self, batch: Any) -> Any:
        """The batch with its lookup input prepared (fields in the model's order; for a
        packed embedding its routing, bounds check and the backward's sort), the work
        the train pipeline runs ahead on a side stream; the step's results are the same."""
        ...

    def batch_loss(self, batch: Any) -> Tensor:
        """The step loss of one batch (a mean over its rows or tasks), a scalar."""
        ...

    def evaluate(
        self,
        batches: Iterable[Any],
        *,
        gather: Gather,
        source: str,
        predictions: PredictionSink | None = None,
    ) -> dict[str, Any]:
        """Metrics over ``batches``, this rank's part of the data at ``source``.

        Args:
            batches: this rank's evaluation batches.
            gather: concatenates a per-rank tensor over ranks, for metrics over all rows.
            source: the data's path, for messages.
            predictions: when given, called once with the per-row columns of
                :mod:`recaccel.train.evaluation.predictions`.
        """
        ...


def loss_denominator(batch: Batch | TaskBatch, loss: Loss) -> float:
    """What the step loss of ``batch`` is a mean over: tasks with real query rows (meta),
    rows (BCE, whose sample weights scale terms of a mean over rows), or the sum of the
    sample weights (weighted MSE)."""
    if isinstance(batch, TaskBatch):
        return float((batch.query_mask.sum(-1) > 0).sum())
    if loss == "mse" and batch.weights is not None:
        return float(batch.weights.double().sum())
    return float(batch.batch_size)


def cache_batches_ahead(cfg: Config) -> int:
    """Batches to prepare ahead of the one training so that host-placed tables have the
    rows of ``model.cache_lookahead`` batches resident (0 without host tables)."""
    return cfg.model.cache_lookahead - 1 if places_tables_on_host(cfg.model) else 0


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    """The mixed-precision context of ``train.precision`` on ``device``.

    ``fp32`` and ``tf32``: none (float32 tensors; how CUDA multiplies them is
    :func:`~recaccel.train.model.precision.matmul_precision`'s switch). ``bf16``:
    ``torch.autocast`` to bfloat16, which runs the MLPs and the interaction in bfloat16
    (on CUDA, and on CPU); the embedding lookup opts out
    (:class:`~recaccel.models.arches.SparseArch`), and parameters, gradients and the dense
    optimizer stay float32.
    """
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


class DLRMObjective:
    """Click (BCE) or rating (MSE) loss of a DLRM on row batches.

    Under ``train.precision = "bf16"`` the forward runs under :func:`autocast`; the
    logits are cast to float32 and the loss and metrics are computed in float32.
    :meth:`evaluate` sets the run's TF32 switches itself
    (:func:`~recaccel.train.model.precision.matmul_precision`), so evaluating a checkpoint
    alone multiplies as its training did.

    A step is :meth:`embed` (the sparse lookup; its backward applies the fused sparse
    update) then :meth:`head_loss` (the dense head and the loss): the pipelined steps
    (:mod:`recaccel.train.loop.step`) call them apart.

    Args:
        cfg: the run's config.
        model: the DLRM.
        loss: the loss kind.
        head: the dense head ``(dense [B, Dd], pooled [B, F, D]) -> logits [B]``
            (default ``model.head``; :func:`recaccel.train.model.dense_head.build_head` gives a
            compiled or CUDA-graphed one).
    """

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        loss: Loss,
        head: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.module = model
        self.loss = loss
        self._head = head
        self.batches_ahead = cache_batches_ahead(cfg)
        # Called with each training batch's (or part's) logits and labels (train.metric_window).
        self.watch: Callable[[Tensor, Tensor], None] | None = None

    @property
    def head(self) -> Callable[[Tensor, Tensor], Tensor]:
        """The dense head ``(dense [B, Dd], pooled [B, F, D]) -> logits [B]``."""
        return self._head if self._head is not None else self.module.head

    def reader(self, path: str, *, train: bool, rank: int = 0, world_size: int = 1) -> BatchReader:
        return BatchReader.from_config(path, self.cfg.data, train=train, rank=rank, world_size=world_size)

    def prepare(self, batch: Batch) -> Batch:
        return dataclasses.replace(batch, sparse=self.module.prepare_sparse(batch.sparse))

    @property
    def embedding(self) -> nn.Module:
        """The model's embedding module (what the micro-batch step updates once per step)."""
        return self.module.sparse_arch.embedding

    def pooled_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype :meth:`embed` gives under the run's precision on ``device``: what the
        steps that look rows up without a graph (micro-batches, overlap) ask for."""
        with autocast(self.cfg.train.precision, device):
            return self.module.sparse_arch.pooled_dtype(device.type)

    def embed(self, batch: Batch) -> Tensor:
        """Pooled embeddings [B, F, D] of the batch (pooled in float32 with autocast off; float32,
        or the autocast dtype where the model's arches cast to it: ``SparseArch.autocast_output``)."""
        return self.module.embed(batch.sparse)

    def _forward(self, batch: Batch) -> Tensor:
        """Logits [B] of the model under the run's precision.

        The lookup runs right before the head call that reads it, so with a CUDA-graphed
        head it writes into the graph's input buffer
        (:func:`~recaccel.train.model.head_input.embed_for_head`); :meth:`embed`, which a
        pipeline calls ahead of a pending backward, never does.
        """
        with autocast(self.cfg.train.precision, batch.labels.device):
            if self._head is None:
                return self.module(batch)
            return self._head(batch.dense, embed_for_head(self.module, self._head, batch.dense, batch.sparse))

    def head_loss(self, batch: Batch, pooled: Tensor) -> Tensor:
        """The step loss of ``batch`` from its pooled embeddings [B, F, D]."""
        with autocast(self.cfg.train.precision, batch.labels.device):
            logits = self.head(batch.dense, pooled)
        return self._loss(logits.float(), batch.labels, batch.weights)

    def batch_loss(self, batch: Batch) -> Tensor:
        return self._loss(self._forward(batch).float(), batch.labels, batch.weights)

    def _loss(self, logits: Tensor, labels: Tensor, weights: Tensor | None) -> Tensor:
        if self.watch is not None:
            self.watch(logits, labels)
        if self.loss == "bce":
            return nn.functional.binary_cross_entropy_with_logits(logits, labels, weight=weights)
        err = (logits - labels).pow(2)
        return err.mean() if weights is None else (err * weights).sum() / weights.sum()

    def part_loss(self, batch: Batch, rows: slice, pooled: Tensor, denominator: float) -> Tensor:
        """Rows ``rows`` of ``batch``'s step loss: their loss terms summed over
        ``denominator`` (:func:`loss_denominator` of the whole batch), so the parts of a
        batch sum to its :meth:`batch_loss`.

        Args:
            batch: the whole batch.
            rows: the part's rows.
            pooled: [rows, F, D] the part's pooled embeddings.
            denominator: the whole batch's loss denominator.
        """
        labels = batch.labels[rows]
        weights = None if batch.weights is None else batch.weights[rows]
        with autocast(self.cfg.train.precision, labels.device):
            logits = self.head(batch.dense[rows], pooled).float()
        if self.watch is not None:
            self.watch(logits, labels)
        if self.loss == "bce":
            terms = nn.functional.binary_cross_entropy_with_logits(
                logits, labels, weight=weights, reduction="sum"
            )
            return terms / denominator
        err = (logits - labels).pow(2)
        return (err.sum() if weights is None else (err * weights).sum()) / denominator

    def predictions(self, batches: Iterable[Batch]) -> tuple[Tensor, Tensor]:
        """Float32 logits [N] and labels [N] (the forward under the run's precision)."""
        with matmul_precision(self.cfg.train.precision):
            return predict(self._forward, batches)

    def metrics(self, logits: Tensor, labels: Tensor) -> dict[str, Any]:
        """Metrics of predictions [N]; a NaN or infinite one raises MetricError (one line)."""
        check_finite(
            logits, "evaluation: model predictions", "the model has diverged (a lower optim.lr may help)"
        )
        return binary_metrics(logits, labels) if self.loss == "bce" else rating_metrics(logits, labels)

    def evaluate(
        self,
        batches: Iterable[Batch],
        *,
        gather: Gather,
        source: str,
        predictions: PredictionSink | None = None,
    ) -> dict[str, Any]:
        """Metrics over the predictions of all ranks (gathered: AUC is not a mean of parts);
        ``predictions`` gets every rank's rows, in rank order.

        Raises:
            DataError: no rank had an evaluation row.
        """
        if predictions is None and self.loss == "bce":  # bounded memory: no row is kept
            with matmul_precision(self.cfg.train.precision):
                acc = gather_streaming(stream_binary(self._forward, batches), gather)
            if acc.compute()["eval_rows"] == 0:
                raise DataError(f"evaluation data {source} has no rows")
            return streamed_metrics(acc)
        with matmul_precision(self.cfg.train.precision):
            logits, labels, weights = predict_rows(self._forward, batches)
        logits, labels = gather(logits), gather(labels)
        if labels.numel() == 0:
            raise DataError(f"evaluation data {source} has no rows")
        metrics = self.metrics(logits, labels)
        if predictions is not None:
            predictions(row_columns(logits, labels, None if weights is None else gather(weights), self.loss))
        return metrics


class MetaObjective:
    """MAML query loss after per-task adaptation on the support rows.

    Under ``train.precision = "bf16"`` the learner runs its step under bfloat16 autocast
    (:class:`~recaccel.meta.learner.MetaLearner`): the matmuls of the shared work and
    of the whole inner loop in bfloat16; losses and adapted parameters in float32.
    """

    def __init__(self, cfg: Config, model: nn.Module, loss: Loss) -> None:
        from recaccel.meta.learner import MetaLearner

        self.cfg = cfg
        self.loss = loss
        self.batches_ahead = cache_batches_ahead(cfg)
        self.module = MetaLearner(
            model, cfg.meta, loss=loss, engine=cfg.meta.engine, precision=cfg.train.precision
        )

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

    def prepare(self, batch: TaskBatch) -> TaskBatch:
        """The task batch with its support and query rows stacked for the one lookup of
        the step, and prepared for the model's embedding."""
        stacked = self.module.model.prepare_sparse(batch.concat_sparse())
        return dataclasses.replace(batch, stacked=stacked)

    def batch_loss(self, batch: TaskBatch) -> Tensor:
        return self.module.step_loss(batch)[0]

    def evaluate(
        self,
        batches: Iterable[TaskBatch],
        *,
        gather: Gather,
        source: str,
        predictions: PredictionSink | None = None,
    ) -> dict[str, Any]:
        """Per-task metrics; every rank evaluates whole tasks, so nothing is gathered
        (``predictions`` gets this rank's tasks)."""
        from recaccel.meta.evaluation import evaluate_meta

        if predictions is None:
            return evaluate_meta(self.module, batches)
        parts: list[dict[str, Tensor]] = []

        def record(tb: TaskBatch, pred: Tensor, pred0: Tensor) -> None:
            parts.append(task_columns(tb, pred, pred0, self.loss))

        metrics = evaluate_meta(self.module, batches, record=record)
        predictions(concat_columns(parts))
        return metrics
