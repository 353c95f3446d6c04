"""The exact overlapped step (``train.pipeline = "overlap"``): the next batch's lookup runs
while this step's weight gradients and dense optimizer step run, with no staleness.

A DLRM step's backward has two kinds of work: what the sparse update needs (the top MLP's
input gradients, the interaction's backward, which yield the gradient of the pooled
embeddings) and what only the dense optimizer needs (every MLP layer's weight-gradient
GEMMs). :class:`OverlapStep` orders them so the embedding is up to date as early as
possible:

1. forward of the dense head on this batch's pooled embeddings, a leaf tensor looked up
   without a graph by the previous step (below; the first step of a run, or after a
   resume, looks its batch up itself);
2. ``backward()``: every MLP layer computes its input gradient only and queues its weight
   and bias gradients (:mod:`recaccel.models.split_linear`), so autograd returns once
   the pooled gradient is known (the bottom MLP's input gradients still run in it, and
   the DCN-v2 cross layers' whole backward); the sparse update is then applied with it
   (:meth:`~recaccel.ops.embedding.PackedEmbeddingBag.apply_gradient`, exactly what the
   fused backward does);
3. the embedding is now what the next step must read: the next batch's lookup starts
   (:meth:`~recaccel.ops.embedding.PackedEmbeddingBag.lookup_rows`; on CUDA on a side
   stream);
4. the queued weight-gradient GEMMs run (on the step's stream), and the dense optimizer
   step after them (:meth:`~recaccel.train.loop.runner.EagerStep.train_step`): on CUDA both
   overlap the lookup. The next step's dense
   forward waits for the lookup's event.

With ``train.micro_batches = k`` each part's dense forward and backward run in turn on
its own lookup, as :class:`~recaccel.train.loop.step.MicroBatchStep` does; the weight
gradients of every part but the last run after that part's backward (micro-batches keep
one part's activations), the last part's after the next lookup has started.

Exactness: the lookup reads only the embedding's rows, which nothing after the sparse
update touches until the next step; the dense gradients are the unsplit layers' bit for
bit; the lookup and the update are the packed embedding's, bit for bit those of its
fused forward and backward. So a run trains exactly what ``off`` trains (with micro-batches
what ``sync`` with them trains; bit for bit on CPU, on CUDA wherever the kernels are
deterministic), and a resumed run looks its first
batch up afresh from the checkpoint's rows, which are the rows the lookup would have read:
resume is exact too.

On CPU every step runs in order on one stream: the results, not the speed, of the
overlap. A step that raises (in backward or after) drops its queued work and the pending
lookup: no weight gradient of a failed step reaches ``.grad`` later.

Not combined with ``train.cuda_graphs`` or ``train.compile`` (refused by the config): a
captured or compiled head's backward would have to split its weight gradients itself.

Streams (CUDA): the side stream waits for the step's stream (the update and the batch's
hand-over) before the lookup; the batch's tensors are marked used by the side stream and
the looked-up tensor by the step's stream (``record_stream``), so the caching allocator
does not reuse their memory while the other stream may still read it.

Shapes: B batch, F fields, D dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.models.arches import MLP
from recaccel.models.dlrm import DLRM
from recaccel.models.split_linear import WgradQueue
from recaccel.ops.embedding import PackedEmbeddingBag
from recaccel.sparse import Batch
from recaccel.train.loop.parts import part_bounds
from recaccel.train.loop.pipeline import StepInput, batch_tensors
from recaccel.train.loop.runner import EagerStep
from recaccel.train.model.objectives import DLRMObjective, Objective, loss_denominator


@dataclass
class _Lookup:
    """A batch's pooled embeddings [B, F, D] (or each micro-batch's), looked up ahead, and the
    event that marks them ready (None on CPU)."""

    batch: Batch
    pooled: list[Tensor]  # one tensor, or one per micro-batch
    ready: torch.cuda.Event | None


class OverlapStep(EagerStep):
    """The step of ``train.pipeline = "overlap"`` (see the module's docstring).

    Args:
        objective: a DLRM objective whose model's MLPs can split their backward
            (:func:`overlap_unsupported` is None).
        device: where the step runs.
        parts: ``train.micro_batches``: with k > 1 each part's dense forward and backward
            runs in turn (weight gradients accumulate), and the sparse update once, as
            :class:`~recaccel.train.loop.step.MicroBatchStep` does: its results, bit for bit.
    """

    def __init__(self, objective: DLRMObjective, device: torch.device, parts: int = 1) -> None:
        reason = overlap_unsupported(objective)
        if reason is not None:
            raise ConfigError(f"train.pipeline=overlap needs {reason}; use train.pipeline=sync")
        self.objective = objective
        self.device = device
        self.parts = parts
        self.embedding: PackedEmbeddingBag = objective.embedding
        self.queue = WgradQueue()
        self._mlps = [m for m in objective.module.modules() if isinstance(m, MLP)]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead: _Lookup | None = None

    def forward_backward(self, item: StepInput) -> Tensor:
        """This step's loss, gradients (weight gradients included) and sparse update
        applied, and the next batch's lookup started; returns the detached loss."""
        batch = item.batch
        ahead, self._ahead = self._ahead, None
        try:
            pooled = self._pooled(batch, ahead)
            if self.parts == 1:
                loss, grad = self._whole(batch, pooled[0])
            else:
                loss, grad = self._in_parts(batch, pooled)
            self.embedding.apply_gradient(batch.sparse, grad)
            del pooled, grad
            if item.following is not None:
                self._ahead = self._look_up(item.following)
            self.queue.run()
        except BaseException:
            self._ahead = None
            raise
        finally:
            self.queue.clear()  # a no-op after run(); drops a failed step's work
        return loss

    def _whole(self, batch: Batch, pooled: Tensor) -> tuple[Tensor, Tensor]:
        """The batch's loss (detached) and pooled gradient [B, F, D]: ``off``'s math."""
        with split_backward(self._mlps, self.queue):
            loss = self.objective.head_loss(batch, pooled)
        loss.backward()
        return loss.detach(), pooled.grad

    def _in_parts(self, batch: Batch, pooled: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Micro-batches (``train.micro_batches``): the parts' losses summed and their pooled
        gradients joined, the micro-batch step's math. Every part's weight gradients but the
        last part's run after its backward (activations are not kept for all parts)."""
        bounds = part_bounds(batch.batch_size, self.parts)
        denominator = max(loss_denominator(batch, self.objective.loss), 1e-12)
        total = torch.zeros((), device=batch.labels.device)
        grads = []
        for j, ((lo, hi), part) in enumerate(zip(bounds, pooled, strict=True)):
            with split_backward(self._mlps, self.queue):
                loss = self.objective.part_loss(batch, slice(lo, hi), part, denominator)
            loss.backward()
            total += loss.detach()
            grads.append(part.grad)
            if j + 1 < len(bounds):
                self.queue.run()
        return total, torch.cat(grads)

    def _pooled(self, batch: Batch, ahead: _Lookup | None) -> list[Tensor]:
        """``batch``'s pooled embeddings (per part) as leaves that collect their gradient:
        the lookup made ahead when it is this batch's, otherwise one made now."""
        if ahead is None or ahead.batch is not batch:
            ahead = _Lookup(batch, self._rows(batch), None)
        if ahead.ready is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(ahead.ready)
            for part in ahead.pooled:
                part.record_stream(main)
        return [part.requires_grad_(True) for part in ahead.pooled]

    def _rows(self, batch: Batch) -> list[Tensor]:
        """The pooled rows of the batch [B, F, D], or of each part of it, without a graph."""
        dtype = self.objective.pooled_dtype(self.device)
        if self.parts == 1:
            return [self.embedding.lookup_rows(batch.sparse, 0, batch.batch_size, out_dtype=dtype)]
        return [
            self.embedding.lookup_rows(batch.sparse, lo, hi, out_dtype=dtype)
            for lo, hi in part_bounds(batch.batch_size, self.parts)
        ]

    def _look_up(self, batch: Batch) -> _Lookup:
        """The lookup of the next batch, on the side stream on CUDA."""
        if self._stream is None:
            return _Lookup(batch, self._rows(batch), None)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # after the update and the hand-over
        with torch.cuda.stream(side):
            pooled = self._rows(batch)
            ready = torch.cuda.Event()
            ready.record(side)
        for tensor in batch_tensors(batch):
            if tensor.is_cuda:
                tensor.record_stream(side)
        return _Lookup(batch, pooled, ready)


@contextlib.contextmanager
def split_backward(mlps: list[MLP], queue: WgradQueue) -> Iterator[None]:
    """Within the block, the forwards of ``mlps`` defer their weight gradients to ``queue``;
    after it, the MLPs are as before (a model shared with other steps, or evaluated
    between steps, runs its plain layers)."""
    before = [m.wgrad_queue for m in mlps]
    for m in mlps:
        m.wgrad_queue = queue
    try:
        yield
    finally:
        for m, old in zip(mlps, before):
            m.wgrad_queue = old


def overlap_unsupported(objective: Objective) -> str | None:
    """Why ``train.pipeline = "overlap"`` cannot run this objective, or None when it can."""
    if not isinstance(objective, DLRMObjective):
        return "train.mode=dlrm"
    model = objective.module
    if not isinstance(model, DLRM) or type(model).embed is not DLRM.embed:
        # The step looks batches up through the SparseArch's embedding, as DLRM.embed does.
        return f"recaccel's DLRM (its lookup is its SparseArch's), not a {type(model).__name__}"
    if not any(isinstance(m, MLP) for m in model.modules()):
        return (
            f"dense layers built as recaccel MLPs (their backward splits into input and weight "
            f"gradients); the {type(model).__name__} has none"
        )
    embedding = objective.embedding
    if not isinstance(embedding, PackedEmbeddingBag):
        return f"recaccel's packed embedding, not a {type(embedding).__name__}"
    reason = embedding.deferred_update_unsupported()
    if reason is not None:
        return f"a packed embedding that applies its update itself, not one with {reason}"
    return None
