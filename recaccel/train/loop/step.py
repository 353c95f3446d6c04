"""One training step, as ``train.pipeline``, ``train.micro_batches`` and
``train.cuda_graph_scope`` shape it: :meth:`StepRunner.train_step` (the eager runners:
``zero_grad``, their forward and backward, the dense optimizer's ``step``).

- :class:`PlainStep`: the objective's step loss, then backward (a fused embedding
  applies its sparse update inside backward).
- :class:`SemiSyncStep` (``train.pipeline = "semi_sync"``): the next batch's embedding
  lookup runs before this step's backward, so it reads the rows before this step's
  sparse update (one step stale, as TorchRec's semi-sync pipeline); on CUDA it runs on a
  side stream alongside this step's dense forward.
- :class:`~recaccel.train.loop.overlap.OverlapStep` (``train.pipeline = "overlap"``): the
  next batch's lookup after this step's sparse update, alongside its weight gradients
  and dense optimizer step (the results of ``off``; see :mod:`recaccel.train.loop.overlap`).
- :class:`~recaccel.train.loop.step_graph.GraphedStep` (``train.cuda_graph_scope = "step"``):
  the whole step, preparation and dense optimizer step included, captured in one CUDA
  graph and replayed.
- :class:`MicroBatchStep` (``train.micro_batches = k``): the batch's rows in k parts;
  each part's lookup (no graph) runs on a side stream ahead of the previous part's dense
  forward and backward; dense gradients accumulate over the parts, and the sparse update
  is applied once, with the gradient of the whole batch's pooled embeddings.

Shapes: B batch, F fields, D dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.config import TrainConfig
from recaccel.errors import ConfigError
from recaccel.ops.embedding import PackedEmbeddingBag
from recaccel.train.loop.overlap import OverlapStep
from recaccel.train.loop.parts import part_bounds
from recaccel.train.loop.pipeline import StepInput
from recaccel.train.loop.runner import EagerStep, StepRunner
from recaccel.train.loop.step_graph import GraphedStep
from recaccel.train.model.objectives import DLRMObjective, Objective, loss_denominator


class PlainStep(EagerStep):
    """The objective's loss and its backward."""

    def __init__(self, objective: Objective) -> None:
        self.objective = objective

    def forward_backward(self, item: StepInput) -> Tensor:
        loss = self.objective.batch_loss(item.batch)
        loss.backward()
        return loss.detach()


class SemiSyncStep(EagerStep):
    """A step whose next batch's lookup runs before its own sparse update.

    The lookup of batch i+1 (with its graph: its backward, in step i+1, applies that
    batch's sparse update to the rows as they are then) is made after batch i's forward
    and before its backward. A resumed run looks the first batch up afresh (not stale),
    so it repeats an uninterrupted run's rows but not its values bit for bit.

    Args:
        objective: a DLRM objective.
        device: where the step runs.
    """

    def __init__(self, objective: DLRMObjective, device: torch.device) -> None:
        self.objective = objective
        self._carried: Tensor | None = None  # the lookup of the batch the next step trains
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device

    def forward_backward(self, item: StepInput) -> Tensor:
        pooled = self._carried if self._carried is not None else self.objective.embed(item.batch)
        self._carried = None
        if item.following is None:
            loss = self.objective.head_loss(item.batch, pooled)
        elif self._stream is None:
            loss = self.objective.head_loss(item.batch, pooled)
            self._carried = self.objective.embed(item.following)
        else:
            loss = self._overlapped(item, pooled)
        loss.backward()
        return loss.detach()

    def _overlapped(self, item: StepInput, pooled: Tensor) -> Tensor:
        """CUDA: the next lookup on the side stream while this step's dense forward runs;
        the backward (with the sparse update) waits for it."""
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)  # the rows as the previous step's update left them
        with torch.cuda.stream(self._stream):
            carried = self.objective.embed(item.following)
        loss = self.objective.head_loss(item.batch, pooled)
        main.wait_stream(self._stream)
        carried.record_stream(main)
        self._carried = carried
        return loss


class MicroBatchStep(EagerStep):
    """Dense work per micro-batch, one sparse update per step.

    Args:
        objective: a DLRM objective whose embedding supports a deferred update
            (``apply_gradient``: the packed embedding in fused mode).
        parts: k, the number of micro-batches (a batch of B < k rows runs in B parts).
        device: where the step runs.
    """

    def __init__(self, objective: DLRMObjective, parts: int, device: torch.device) -> None:
        self.objective = objective
        self.parts = parts
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def forward_backward(self, item: StepInput) -> Tensor:
        batch = item.batch
        embedding = self.objective.embedding
        bounds = part_bounds(batch.batch_size, self.parts)
        lookups = self._lookups(embedding, batch.sparse, bounds)
        denominator = max(loss_denominator(batch, self.objective.loss), 1e-12)
        total = torch.zeros((), device=batch.labels.device)
        grads = []
        for (lo, hi), (part, ready) in zip(bounds, lookups):
            self._wait(part, ready)
            part.requires_grad_(True)
            loss = self.objective.part_loss(batch, slice(lo, hi), part, denominator)
            loss.backward()
            total += loss.detach()
            grads.append(part.grad)
        embedding.apply_gradient(batch.sparse, torch.cat(grads))
        return total

    def _lookups(
        self, embedding: PackedEmbeddingBag, sparse, bounds: list[tuple[int, int]]
    ) -> list[tuple[Tensor, torch.cuda.Event | None]]:
        """Every part's pooled rows [hi - lo, F, D] (no graph); on CUDA queued on the side
        stream, each with the event its part's dense work waits on."""
        dtype = self.objective.pooled_dtype(self.device)
        if self._stream is None:
            return [(embedding.lookup_rows(sparse, lo, hi, out_dtype=dtype), None) for lo, hi in bounds]
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)  # the rows as the previous step's update left them
        out = []
        with torch.cuda.stream(self._stream):
            for lo, hi in bounds:
                part = embedding.lookup_rows(sparse, lo, hi, out_dtype=dtype)
                ready = torch.cuda.Event()
                ready.record(self._stream)
                out.append((part, ready))
        return out

    def _wait(self, part: Tensor, ready: torch.cuda.Event | None) -> None:
        if ready is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_event(ready)
        part.record_stream(main)


def build_step(train: TrainConfig, objective: Objective, device: torch.device) -> StepRunner:
    """The step runner ``train.pipeline`` and ``train.micro_batches`` ask for.

    Raises:
        ConfigError: micro-batches with an embedding that cannot defer its update;
            ``overlap`` where it cannot hold (:mod:`recaccel.train.loop.overlap`); a
            whole-step graph where it cannot (:mod:`recaccel.train.loop.step_graph`).
    """
    t = train
    if t.cuda_graphs and t.cuda_graph_scope == "step":  # the config allows pipeline off or sync only
        return GraphedStep(objective, device)
    if t.pipeline == "overlap":  # the config refused graphs and compile with it
        return OverlapStep(objective, device, t.micro_batches)
    if t.micro_batches > 1:
        reason = _deferred_update_unsupported(objective)
        if reason is not None:
            raise ConfigError(
                f"train.micro_batches={t.micro_batches} needs {reason}; use train.micro_batches=1"
            )
        return MicroBatchStep(objective, t.micro_batches, device)
    if t.pipeline == "semi_sync":
        return SemiSyncStep(objective, device)
    return PlainStep(objective)


def _deferred_update_unsupported(objective: Objective) -> str | None:
    """Why the objective's embedding cannot take one sparse update per step from
    micro-batch gradients, or None when it can."""
    if not isinstance(objective, DLRMObjective):
        return "train.mode=dlrm"
    embedding = objective.embedding
    if not isinstance(embedding, PackedEmbeddingBag):
        return f"recaccel's packed embedding, not a {type(embedding).__name__}"
    reason = embedding.deferred_update_unsupported()
    return None if reason is None else f"a packed embedding that can defer its update, not one with {reason}"
