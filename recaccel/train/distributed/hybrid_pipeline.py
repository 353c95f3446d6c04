"""TorchRec's own train pipelines over the hybrid model (``train.pipeline`` in hybrid mode).

``sync`` runs TorchRec's ``TrainPipelineSparseDist``: while batch i trains, the input
all-to-all of batch i+1 (ids to the ranks owning their rows) has already been issued
and batch i+2 is taken from the loader (on CUDA: a copy stream and a data-dist stream;
on CPU the same order on one stream). The math is that of ``off``: same batches, same
lookups, same updates, in the same order.

``semi_sync`` runs ``TrainPipelineSemiSync`` from the first batch: batch i+1's
embedding lookup and output all-to-all run before batch i's embedding backward (where
FBGEMM applies the sparse update), so each batch is looked up on rows one step stale.
Opt-in; results differ from ``off``. CUDA only: TorchRec 1.8's semi-sync pipeline calls
``record_stream`` with the current stream, which a CPU stream does not support
(``RuntimeError: unknown parameter type``); on CPU it is a ConfigError.

How recaccel's step fits TorchRec's pipeline contract:

- The pipelined input is a :class:`PipelinedBatch` (TorchRec's ``Pipelineable``): the
  local Batch, the KeyedJaggedTensor of its sharded features (the pipeline starts the
  input all-to-all on it ahead), and what the step needs once it trains: the global
  loss normaliser and row count of the per-step agreement, and the reader position
  after the batch. Every step thus reports the position paired with *its* batch while
  the pipeline holds later ones, so a checkpoint resumes at the next untrained batch.
- The agreement (one small allreduce: every rank has a batch, global normaliser and
  rows) runs when the pipeline takes a batch from the loader: every rank takes batches
  at the same points of the same code, so the collectives pair up; when one rank runs
  dry, all stop taking and the pipeline trains the batches it holds (all agreed).
- The model the pipeline runs is :class:`_StepModel`: ``forward(PipelinedBatch)`` calls
  the sharded ``EmbeddingBagCollection`` on ``batch.kjt`` (the call TorchRec finds by
  FX-tracing and replaces by its pipelined forward) and hands the pooled result to a
  leaf module that runs the objective's ordinary loss with the lookup fed that result
  (:meth:`recaccel.train.distributed.lookup.GuardedLookup.feed`); it returns
  ``(this rank's share of the global mean loss [1], (reader position, rows))``.
- The optimizer the pipeline steps is :class:`_SyncedOptimizer`: ``step`` sums the dense
  gradients (and the loss share) over ranks in one bucketed allreduce, then steps the
  dense and the replicated-table optimizers, exactly as the non-pipelined step.
- Evaluation between steps: a lookup outside a pipelined step detaches the pipeline
  (TorchRec's ``detach``, the sharded module gets its own forward back); the next
  ``progress`` re-attaches it and the batches in flight go on.

Memory in flight beyond ``off``: two more local batches (``sync``: i+1 distributed,
i+2 taken) or three (``semi_sync``), plus the received ids of the distributed ones
and, for ``semi_sync``, one batch's pooled embeddings [B, F, D].

Meta-learning (TaskBatches) runs ``train.pipeline = "off"`` in hybrid mode: MAML looks
rows up several times per step, TorchRec's pipelined forward serves one lookup a batch.

Shapes: B local batch, F fields, D embedding dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync, TrainPipelineSparseDist
from torchrec.streamable import Pipelineable

from recaccel.config import PipelineMode
from recaccel.errors import ConfigError, DataError
from recaccel.sparse import Batch
from recaccel.train.loop.parallel import BatchWithState, StepDone
from recaccel.train.loop.pipeline import batch_tensors
from recaccel.train.model.objectives import DLRMObjective, Objective, loss_denominator


class PipelinedParallel(Protocol):
    """What the pipeline needs of the hybrid layout: ``HybridParallel`` of
    ``recaccel.train.distributed.hybrid``, named by its shape so neither module imports
    the other."""

    device: torch.device
    dmp: Any  # TorchRec's DistributedModelParallel over the sharded tables, or None
    embedding: Any  # the TorchRecEmbedding after ``wrap``
    step_rows: int

    def collectives(self, what: str) -> AbstractContextManager[None]: ...

    def agree(self, batch: Any | None, objective: Objective) -> tuple[float, int] | None: ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def sync_and_step(self, optimizer: torch.optim.Optimizer, share: Tensor) -> Tensor: ...


@dataclasses.dataclass
class PipelinedBatch(Pipelineable):
    """One agreed local batch as TorchRec's pipeline carries it.

    Attributes:
        batch: this rank's Batch (B rows).
        kjt: the KeyedJaggedTensor of its sharded features, in the lookup's fixed order
            (what the pipeline distributes ahead).
        denominator: the step's global loss normaliser (sum over ranks).
        rows: the step's training rows over all ranks.
        reader_state: the reader position after this batch.
    """

    batch: Batch
    kjt: Any
    denominator: float
    rows: int
    reader_state: dict[str, Any]

    def to(self, device: torch.device, non_blocking: bool = False) -> PipelinedBatch:
        return dataclasses.replace(
            self,
            batch=self.batch.to(device, non_blocking=non_blocking),
            kjt=self.kjt.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks every tensor used by ``stream`` (the caching allocator keeps it until then).

        A CPU stream (TorchRec's semi-sync pipeline passes the current one) needs none.
        """
        if not isinstance(stream, torch.cuda.Stream):
            return
        for tensor in batch_tensors(self.batch):
            tensor.record_stream(stream)
        self.kjt.record_stream(stream)


class _StepLoss(nn.Module):
    """The step's loss from the pooled lookup: a leaf of TorchRec's trace (no sharded module)."""

    def __init__(
        self, parallel: PipelinedParallel, objective: Objective, optimizer: _SyncedOptimizer
    ) -> None:
        super().__init__()
        # Plain attributes: neither is part of what the pipeline's model holds.
        object.__setattr__(self, "parallel", parallel)
        object.__setattr__(self, "objective", objective)
        object.__setattr__(self, "optimizer", optimizer)

    def forward(self, item: PipelinedBatch, pooled: Any) -> tuple[Tensor, tuple[dict[str, Any], int]]:
        """This rank's share of the global mean loss [1] and (reader position, rows)."""
        with self.parallel.collectives("the training step"):
            lookup = self.parallel.embedding.lookup
            lookup.feed(pooled)
            try:
                loss = self.objective.batch_loss(item.batch)
            finally:
                unused = lookup.clear_feed()
            if unused:
                raise RuntimeError("the pipelined step's pooled embeddings were not used by the model")
        share = loss_denominator(item.batch, self.objective.loss) / max(item.denominator, 1e-12)
        scaled = (loss * share).reshape(1)
        self.optimizer.pending = scaled.detach()
        return scaled, (item.reader_state, item.rows)


class _StepModel(nn.Module):
    """What TorchRec's pipeline runs: ``forward(PipelinedBatch) -> (loss [1], output)``.

    Args:
        sharded: the sharded EmbeddingBagCollection (its call here is what the pipeline
            traces and replaces).
        loss: the leaf computing the loss share.
    """

    def __init__(self, sharded: nn.Module, loss: _StepLoss) -> None:
        super().__init__()
        self.sharded = sharded
        self.loss = loss

    def forward(self, item: PipelinedBatch):
        return self.loss(item, self.sharded(item.kjt))


class _SyncedOptimizer:
    """The optimizer TorchRec's pipeline steps: the hybrid step's dense sync and updates.

    ``step`` sums dense gradients and the step's loss share (:attr:`pending`) over
    ranks, then steps the dense and replicated-table optimizers; :attr:`total` is the
    global mean loss of the step.
    """

    def __init__(self, parallel: PipelinedParallel, optimizer: torch.optim.Optimizer) -> None:
        self.parallel = parallel
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups  # TorchRec's semi-sync checks them
        self.pending: Tensor | None = None
        self.total: Tensor | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.parallel.zero_grad(self.optimizer)

    def step(self) -> None:
        if self.pending is None:
            raise RuntimeError("optimizer step without a pipelined forward")
        self.total = self.parallel.sync_and_step(self.optimizer, self.pending)
        self.pending = None


def _sharded_module(dmp: nn.Module) -> nn.Module:
    found = [m for m in dmp.modules() if isinstance(m, ShardedModule)]
    if len(found) != 1:
        raise RuntimeError(f"expected one sharded EmbeddingBagCollection, found {len(found)}")
    return found[0]


def _pipeline(mode: PipelineMode, model: nn.Module, optimizer: _SyncedOptimizer, device: torch.device):
    if mode == "sync":
        return TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    return TrainPipelineSemiSync(
        model, optimizer, device, execute_all_batches=True, start_batch=0, stash_gradients=False
    )


def check_pipelined(parallel: PipelinedParallel, objective: Objective, mode: PipelineMode) -> None:
    """Raises ConfigError when TorchRec's pipeline cannot run this hybrid setup."""
    if mode == "overlap":  # recaccel.train.loop.overlap runs one process's packed embedding
        raise ConfigError("train.pipeline=overlap runs parallel.mode=single; use train.pipeline=sync")
    if parallel.dmp is None:
        raise ConfigError(
            f"train.pipeline={mode} in parallel.mode=hybrid pipelines the sharded tables' all-to-all; "
            "every table is data_parallel here: use train.pipeline=off"
        )
    if mode == "semi_sync" and parallel.device.type != "cuda":
        # TrainPipelineSemiSync marks the received ids used by the current stream with
        # record_stream (torchrec/distributed/train_pipeline/utils.py, _start_embedding_lookup),
        # which only CUDA tensors and streams have.
        raise ConfigError(
            "train.pipeline=semi_sync in parallel.mode=hybrid runs TorchRec's TrainPipelineSemiSync, "
            f"which needs CUDA streams (device here: {parallel.device.type}); use train.pipeline=sync"
        )
    if not isinstance(objective, DLRMObjective):  # meta: several lookups per step
        raise ConfigError(
            f"train.pipeline={mode} in parallel.mode=hybrid runs DLRM row batches; "
            "meta-learning runs train.pipeline=off"
        )


def pipelined_steps(
    parallel: PipelinedParallel,
    source: Iterable[BatchWithState],
    objective: Objective,
    optimizer: torch.optim.Optimizer,
    mode: PipelineMode,
) -> Iterator[StepDone]:
    """Trains on ``source`` through TorchRec's pipeline of ``mode``; yields after each step.

    Args:
        parallel: the hybrid layout (after ``wrap``).
        source: (local batch, reader position after it) pairs.
        objective: the DLRM objective.
        optimizer: the dense optimizer.
        mode: ``sync`` or ``semi_sync``.

    Raises:
        ConfigError: see :func:`check_pipelined`.
    """
    check_pipelined(parallel, objective, mode)
    synced = _SyncedOptimizer(parallel, optimizer)
    model = _StepModel(_sharded_module(parallel.dmp), _StepLoss(parallel, objective, synced))
    pipeline = _pipeline(mode, model, synced, parallel.device)
    items = _agreed(parallel, source, objective)
    lookup = parallel.embedding.lookup
    lookup.pipeline = pipeline
    try:
        while True:
            with parallel.collectives("the pipelined training step"):
                try:
                    reader_state, rows = pipeline.progress(items)
                except StopIteration:
                    return
            parallel.step_rows = rows
            yield StepDone(synced.total, reader_state, rows)
    finally:  # the model gets its own forward back, for evaluation and the next epoch
        lookup.detach_pipeline()
        lookup.pipeline = None


def _agreed(parallel: PipelinedParallel, source: Iterable[BatchWithState], objective: Objective):
    """The source's batches as :class:`PipelinedBatch` es, for as long as every rank has one."""
    features = parallel.embedding.torchrec_features
    items = iter(source)
    while True:
        pair = next(items, None)
        batch = None if pair is None else pair[0]
        agreed = parallel.agree(batch, objective)
        if agreed is None:
            return
        denominator, rows = agreed
        if batch.sparse.weights is not None:
            raise DataError("TorchRec embeddings here take unweighted ids; the batch has per-id weights")
        kjt = batch.sparse.select(features).to_kjt()
        yield PipelinedBatch(batch, kjt, denominator, rows, pair[1])
