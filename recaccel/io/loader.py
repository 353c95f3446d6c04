"""Device loader: prefetches batches on a background thread and moves them to the device.

On CUDA each host batch (:class:`Batch` or :class:`TaskBatch`) is packed into one
pinned buffer (:mod:`recaccel.io.host_buffer`) and moved with one asynchronous copy on a
side stream (``backend="torch"``), or handed to an NVIDIA DALI pipeline that does the
host-to-device stage (``backend="dali"``, imported only when selected). The batch the
consumer gets is made of views of the one device buffer. What crosses is what the reader
made: int32 ids where the tables fit, and no offsets for a one-hot batch (its
``SparseFeatures`` makes ``arange`` on the device when the offsets are first read).

Synchronization and lifetime. The copy records an event on the side stream; before a
batch is handed out the consumer's current stream waits on that event, and the device
buffer is marked used by the consumer stream (``record_stream``), so the caching
allocator does not reuse it while the consumer's queued work may still read it. A
pinned host buffer is refilled only after the event of its previous copy completed.
Pinned buffers are reused round-robin (``prefetch + 2`` of them, grown as needed).

On CPU the batches are handed out as the reader made them (no packing, no streams);
``prefetch > 0`` still reads ahead on a thread.

The loader tracks the reader position paired with the last batch it *handed out* (not
the last one the thread prefetched), so a checkpoint taken between steps resumes
exactly: the reader's ``iter_with_state()`` pairs each batch with its position, so the
thread reading ahead does not race the state.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recaccel.config import LoaderBackend, choices
from recaccel.errors import ConfigError
from recaccel.io.host_buffer import ALIGN, Layout, layout_of, pack, unpack
from recaccel.io.readers.protocol import Reader
from recaccel.sparse import Batch, TaskBatch

_DONE = object()


@dataclass
class _Staged:
    """A batch on its way to the consumer."""

    batch: Batch | TaskBatch | None  # CPU: the batch itself
    buffer: Tensor | None  # CUDA: the device buffer holding every tensor
    layout: Layout | None
    event: torch.cuda.Event | None
    state: dict[str, Any]


class _PinnedSlot:
    def __init__(self) -> None:
        self.host: Tensor | None = None
        self.event: torch.cuda.Event | None = None


class DeviceLoader:
    """Iterates a reader's batches on ``device``, ``prefetch`` batches ahead.

    Args:
        reader: yields CPU Batches or TaskBatches with its position after each
            (:meth:`Reader.iter_with_state`).
        device: target device.
        prefetch: batches prepared ahead on a background thread (0 = inline).
        backend: host-to-device stage on CUDA: ``"torch"`` (one async copy of the
            pinned buffer) or ``"dali"`` (NVIDIA DALI; must be installed).

    Raises:
        ConfigError: on an unknown backend, DALI on a non-CUDA device, or DALI selected
            but not installed.
    """

    def __init__(
        self,
        reader: Reader,
        device: torch.device | str,
        prefetch: int = 2,
        *,
        backend: LoaderBackend = "torch",
    ) -> None:
        if backend not in choices(LoaderBackend):
            raise ConfigError(
                f"loader backend must be one of {', '.join(choices(LoaderBackend))}, got {backend!r}"
            )
        self.reader = reader
        self.device = torch.device(device)
        self.prefetch = max(0, int(prefetch))
        self.backend = backend
        self._state: dict[str, Any] | None = None
        cuda = self.device.type == "cuda"
        if backend == "dali" and not cuda:
            raise ConfigError(f"loader backend 'dali' copies to a CUDA device; device is {self.device}")
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._dali = _DaliCopier(self.device) if backend == "dali" else None
        self._slots = [_PinnedSlot() for _ in range(self.prefetch + 2)] if cuda else []
        self._next_slot = 0

    def state_dict(self) -> dict[str, Any]:
        """Reader position just after the last batch this loader yielded."""
        return self._state if self._state is not None else self.reader.state_dict()

    def __iter__(self) -> Iterator[Batch | TaskBatch]:
        for batch, _ in self.iter_with_state():
            yield batch

    def iter_with_state(self) -> Iterator[tuple[Batch | TaskBatch, dict[str, Any]]]:
        """Each batch on the device with the reader position just after it.

        The batch is made ready for the stream current when it is taken (``next()``).
        """
        source = self._produce() if self.prefetch <= 0 else self._threaded()
        for staged in source:
            batch = self._handoff(staged)
            self._state = staged.state
            yield batch, staged.state

    def _produce(self) -> Iterator[_Staged]:
        for batch, state in self.reader.iter_with_state():
            yield self._stage(batch, state)

    def _stage(self, batch: Batch | TaskBatch, state: dict[str, Any]) -> _Staged:
        if self._stream is None:
            return _Staged(batch, None, None, None, state)
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        if slot.event is not None:
            slot.event.synchronize()  # the previous copy out of this pinned buffer is done
        layout = layout_of(batch)  # with the field counts: the lookup then needs no device read
        nbytes = layout.nbytes
        if slot.host is None or slot.host.numel() < nbytes:
            slot.host = torch.empty(nbytes + nbytes // 4 + ALIGN, dtype=torch.uint8, pin_memory=True)
        host, layout = pack(batch, slot.host, layout=layout)
        with torch.cuda.stream(self._stream):
            dev = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=self.device)[: layout.nbytes]
            if self._dali is not None:
                self._dali.copy(host, dev, self._stream)
            else:
                dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        slot.event = event
        return _Staged(None, dev, layout, event, state)

    def _handoff(self, staged: _Staged) -> Batch | TaskBatch:
        if staged.event is None:
            return staged.batch
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(staged.event)
        staged.buffer.record_stream(consumer)
        return unpack(staged.buffer, staged.layout)

    def _threaded(self) -> Iterator[_Staged]:
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
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    slots.get_nowait()
                except queue.Empty:
                    pass
                thread.join(timeout=0.05)


class _DaliCopier:
    """Copies a packed host buffer to the device through a one-sample DALI pipeline.

    DALI owns its output only until the next run, so the output is copied on the
    loader's side stream into the device buffer the loader hands out.

    Raises:
        ConfigError: if NVIDIA DALI is not installed.
    """

    def __init__(self, device: torch.device) -> None:
        try:
            from nvidia.dali import fn, types
            from nvidia.dali.pipeline import Pipeline
            from nvidia.dali.plugin.pytorch import feed_ndarray
        except ImportError as e:
            raise ConfigError(
                "loader backend 'dali' needs NVIDIA DALI, which is not installed "
                "(pip install nvidia-dali-cuda120, or use backend='torch')"
            ) from e
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._pipe = Pipeline(
            batch_size=1,
            num_threads=1,
            device_id=index,
            prefetch_queue_depth=1,
            exec_async=False,
            exec_pipelined=False,
        )
        with self._pipe:
            data = fn.external_source(name="packed", device="cpu", dtype=types.UINT8, ndim=1)
            self._pipe.set_outputs(data.gpu())
        self._pipe.build()
        self._feed = feed_ndarray

    def copy(self, host: Tensor, dev: Tensor, stream: torch.cuda.Stream) -> None:
        """Copies ``host`` (uint8 [n]) into ``dev`` (uint8 [n] on the device) ordered on ``stream``."""
        if host.numel() == 0:
            return
        self._pipe.feed_input("packed", [host.numpy()])
        (out,) = self._pipe.run()
        self._feed(out.as_tensor(), dev.view(1, -1), cuda_stream=stream)
