"""The device loader's pinned buffers and side-stream copy, on CUDA, under stress.

For each batch the consumer queues a copy of it (``clone``) on its own stream and drops
the batch on the host right away. Either the consumer is slow on the device (a long spin
kernel queued before each copy) or the loader's side stream is (a spin queued on it
before its next copies). So each kind of bug changes what the consumer's copy reads:

- the consumer stream not waiting on the copy's event: it reads the device buffer
  before the (delayed) copy filled it;
- a device buffer handed to the next batch while the consumer's queued work still reads
  it (no ``record_stream``): the next copy overwrites it first;
- a pinned host buffer refilled before its previous copy ran: the delayed copy moves the
  next batch's bytes.

Every batch the consumer read must equal, bit for bit, the host batch the reader made.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.io.loader import DeviceLoader
from recaccel.sparse import Batch
from tests.helpers.loader_batches import ListReader, assert_same, make_batch

pytestmark = pytest.mark.gpu

SPIN = 2_000_000  # GPU clock cycles per spin (about 1 ms on an H100/H200)


def _snapshot(batch: Batch) -> Batch:
    """A copy made on the current stream, in its queue order (after any spin queued before)."""
    sparse = batch.sparse
    return Batch(
        batch.dense.clone(),
        type(sparse)(
            sparse.keys,
            sparse.values.clone(),
            sparse.offsets.clone(),
            None if sparse.weights is None else sparse.weights.clone(),
        ),
        batch.labels.clone(),
        None if batch.weights is None else batch.weights.clone(),
    )


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("consumer_on_side_stream", [False, True])
@pytest.mark.parametrize("slow", ["consumer", "loader"])
def test_slow_device_work_reads_exactly_the_host_batches(slow, consumer_on_side_stream, prefetch):
    """``slow="consumer"``: the consumer lags the copies (catches a device buffer reused too
    early); ``slow="loader"``: the copies lag the consumer (catch a missing wait on the copy's
    event and a pinned buffer refilled before its copy ran)."""
    # Distinct random content per batch, sizes varying so that buffers are regrown and reused.
    host = [
        make_batch(512 + 37 * (i % 5), 13, ["a", "b", "c"], 100 + i, i % 2 == 0, i % 3 == 0)
        for i in range(40)
    ]
    loader = DeviceLoader(ListReader(host), "cuda", prefetch)
    consumer = torch.cuda.Stream() if consumer_on_side_stream else torch.cuda.current_stream()
    read = []
    with torch.cuda.stream(consumer):
        for batch in loader:
            assert batch.dense.is_cuda and batch.sparse.values.is_cuda
            if slow == "loader":
                with torch.cuda.stream(loader._stream):
                    torch.cuda._sleep(3 * SPIN)  # delays the loader's next copies
            else:
                torch.cuda._sleep(3 * SPIN)  # the consumer's kernel before it reads the batch
            read.append(_snapshot(batch))
            del batch  # the host lets go at once; the device work reading it is still queued
    torch.cuda.synchronize()
    assert len(read) == len(host)
    for i, (got, want) in enumerate(zip(read, host)):
        try:
            assert_same(got.to("cpu"), want)
        except AssertionError as e:
            raise AssertionError(f"batch {i}: the consumer read other bytes than the host batch: {e}") from e


def test_pinned_buffers_are_page_locked_and_reused():
    host = [make_batch(256, 4, ["a"], i, False, False) for i in range(8)]
    loader = DeviceLoader(ListReader(host), "cuda", prefetch=1)
    for _ in loader:
        pass
    pinned = [slot.host for slot in loader._slots if slot.host is not None]
    assert pinned and all(h.is_pinned() for h in pinned)
    assert len(pinned) <= 1 + 2  # prefetch + 2 slots, round-robin: not one per batch
