"""Device loader: prefetches batches on a background thread and moves them to the device.

The loader tracks the reader position of the last batch it *handed out* (not the last
one the thread prefetched), so a checkpoint taken between steps resumes exactly.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from recaccel.io.batch import Batch


class ResumableBatches(Protocol):
    """What the loader needs from a reader."""

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...


_DONE = object()


class DeviceLoader:
    """Iterates a reader's batches on ``device``, ``prefetch`` batches ahead.

    On CUDA the host batch is pinned and copied on a side stream; the consumer's stream
    waits on that copy before use. With ``prefetch=0`` everything runs inline.

    Args:
        reader: yields CPU Batches and reports its position via ``state_dict()``.
        device: target device.
        prefetch: number of batches prepared ahead on a background thread.
    """

    def __init__(self, reader: ResumableBatches, device: torch.device, prefetch: int = 2) -> None:
        self.reader = reader
        self.device = torch.device(device)
        self.prefetch = prefetch
        self._state: dict[str, Any] | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def state_dict(self) -> dict[str, Any]:
        """Reader position just after the last batch this loader yielded."""
        return self._state if self._state is not None else self.reader.state_dict()

    def _to_device(self, batch: Batch) -> tuple[Batch, torch.cuda.Event | None]:
        if self._stream is None:
            return batch.to(self.device), None
        with torch.cuda.stream(self._stream):
            moved = batch.pin_memory().to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return moved, event

    def _produce(self) -> Iterator[tuple[Batch, torch.cuda.Event | None, dict[str, Any]]]:
        for batch in self.reader:
            moved, event = self._to_device(batch)
            yield moved, event, self.reader.state_dict()

    def __iter__(self) -> Iterator[Batch]:
        source = self._produce() if self.prefetch <= 0 else self._threaded()
        for batch, event, state in source:
            if event is not None:
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_event(event)
                # Memory allocated on the side stream must not be reused before the
                # consumer stream is done with it.
                for t in _tensors(batch):
                    t.record_stream(consumer)
            self._state = state
            yield batch

    def _threaded(self) -> Iterator[tuple[Batch, torch.cuda.Event | None, dict[str, Any]]]:
        slots: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work() -> None:
            try:
                for item in self._produce():
                    while not stop.is_set():
                        try:
                            slots.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                slots.put(_DONE)
            except BaseException as e:  # re-raised in the consumer thread
                slots.put(e)

        thread = threading.Thread(target=work, name="recaccel-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = slots.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join()


def _tensors(batch: Batch) -> list[torch.Tensor]:
    sparse = batch.sparse
    found = [batch.dense, batch.labels, batch.weights, sparse.values, sparse.offsets, sparse.weights]
    return [t for t in found if t is not None]
