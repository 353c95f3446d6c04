"""The batch pipeline of a training step (``train.pipeline``): batches prepared ahead.

Each batch the loop trains on first goes through the objective's ``prepare`` (fields in
the model's order; for a packed embedding the routing, the ids' bounds check with its one
host synchronization, and the sort and unique of the backward). Where that runs is what
the modes change:

- ``off``: inline, on the step's stream, just before the step; on CUDA the bounds
  check's synchronization waits for the previous step to finish.
- ``sync``: on CUDA on a side stream, for batch i+1 once batch i's step is queued, so it
  overlaps batch i on the device (the device loader already copies batch i+2 on its own
  stream). The same work on the same inputs: results are those of ``off``, bit for bit
  on CPU (and on CUDA wherever the kernels are deterministic).
- ``semi_sync``: as ``sync``, one batch further ahead: each item also carries the next
  prepared batch (:attr:`StepInput.following`), whose embedding lookup the semi-sync
  step (:class:`recaccel.train.loop.step.SemiSyncStep`) runs before this step's sparse update.
- ``overlap``: as ``semi_sync`` (each item carries the next prepared batch), whose lookup
  the overlapped step (:class:`recaccel.train.loop.overlap.OverlapStep`) runs after this step's
  sparse update, alongside this step's weight gradients and dense optimizer step: the
  results of ``off``.

Synchronization and lifetimes on CUDA: a batch is taken from the loader while the side
stream is current (the loader makes that stream wait for the batch's copy), prepared
there, and an event is recorded; before the step, the step's stream waits on that event
and every tensor of the prepared batch is marked used by it (``record_stream``), so the
caching allocator does not hand their memory out while the step may still read it.

Memory in flight beyond ``off``: one prepared batch (``sync``) or two (``semi_sync``,
``overlap``),
and ``model.cache_lookahead - 1`` more when tables are placed on the host (their rows are
made resident when a batch is prepared): their inputs plus, per pack of a packed
embedding, up to about 44 bytes per id (ids, bags, scale, sort order; see
:mod:`recaccel.ops.embedding.prepared`). The loader's own prefetch (``data.prefetch``) is
counted apart.

Exact resume: every item carries the reader position paired with its own batch, not the
loader's latest (the pipeline has taken later batches from the loader), so a checkpoint
after a step resumes at the next untrained batch: no row is lost or repeated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from recaccel.config import PipelineMode

# The modes whose items carry the next prepared batch (its lookup runs in this step).
CARRIES_NEXT = ("semi_sync", "overlap")


@dataclasses.dataclass
class StepInput:
    """A prepared batch ready for its step.

    Attributes:
        batch: the prepared batch, on the device.
        following: ``semi_sync`` and ``overlap``: the next prepared batch (None for the
            last; always None in the other modes).
        reader_state: the reader position after ``batch`` (what a checkpoint taken after
            its step saves).
    """

    batch: Any
    following: Any | None
    reader_state: dict[str, Any]


class BatchPipeline:
    """Turns (batch, reader position) pairs into prepared :class:`StepInput` items.

    Args:
        prepare: the objective's ``prepare``.
        device: where the batches are.
        mode: ``train.pipeline``.
        ahead: batches prepared ahead of the one handed out, at least (the model's
            embedding cache asks for its lookahead: a batch's rows are made resident
            when it is prepared); ``semi_sync`` and ``overlap`` need one.
    """

    def __init__(
        self, prepare: Callable[[Any], Any], device: torch.device, mode: PipelineMode, ahead: int = 0
    ) -> None:
        self.prepare = prepare
        self.mode = mode
        self.device = device
        side = mode != "off" and device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if side else None
        self._lookahead = max(ahead, 1 if mode in CARRIES_NEXT else 0)

    def __call__(self, source: Iterable[tuple[Any, dict[str, Any]]]) -> Iterator[StepInput]:
        """Yields the items of ``source`` prepared, in order.

        Args:
            source: (batch, reader position after it) pairs.
        """
        it = iter(source)
        ready: list[tuple[Any, dict[str, Any], torch.cuda.Event | None]] = []
        while True:
            while len(ready) <= self._lookahead:
                item = self._take(it)
                if item is None:
                    break
                ready.append(item)
            if not ready:
                return
            batch, state, event = ready.pop(0)
            self._hand_over(batch, event)
            following = None
            if self.mode in CARRIES_NEXT and ready:
                following, _, next_event = ready[0]
                self._hand_over(following, next_event)
                ready[0] = (following, ready[0][1], None)
            yield StepInput(batch, following, state)

    def _take(self, it: Iterator) -> tuple[Any, dict[str, Any], torch.cuda.Event | None] | None:
        """The next batch prepared (on the side stream when there is one), or None at the end."""
        if self._stream is None:
            pair = next(it, None)
            return None if pair is None else (self.prepare(pair[0]), pair[1], None)
        with torch.cuda.stream(self._stream):
            # Taken while the side stream is current: the loader makes it wait for the copy.
            pair = next(it, None)
            if pair is None:
                return None
            prepared = self.prepare(pair[0])
            event = torch.cuda.Event()
            event.record(self._stream)
        return prepared, pair[1], event

    def _hand_over(self, batch: Any, event: torch.cuda.Event | None) -> None:
        """Makes the step's stream wait for ``batch``'s preparation and own its tensors."""
        if event is None:
            return
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for tensor in batch_tensors(batch):
            if tensor.is_cuda:
                tensor.record_stream(consumer)


def batch_tensors(batch: Any) -> Iterator[Tensor]:
    """Every tensor a (prepared) batch holds: its fields and a prepared lookup's arrays.

    Walks dataclasses, lists, tuples and dicts; other objects hold no tensors.
    """
    if isinstance(batch, Tensor):
        yield batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from batch_tensors(getattr(batch, field.name))
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from batch_tensors(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from batch_tensors(item)
