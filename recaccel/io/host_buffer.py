"""One contiguous buffer per batch: pack a Batch / TaskBatch into bytes and back.

Every tensor of the batch is copied into one uint8 buffer at an offset aligned to
:data:`ALIGN` bytes; :func:`unpack` rebuilds the batch from views of a buffer with the
same bytes (the host buffer itself, or its copy on the device), each view reinterpreted
with its dtype and shape. So a host-to-device transfer is one copy of one buffer.

The :class:`Layout` records the structure: batch kind, the sparse keys, and per tensor
slot its (offset, dtype, shape), or None for an absent optional tensor (weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.sparse import Batch, SparseFeatures, TaskBatch

ALIGN = 64
_BATCH_SLOTS = 6  # dense, labels, weights, sparse values, sparse offsets, sparse weights


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a packed batch lives.

    Attributes:
        kind: ``"batch"`` or ``"task_batch"``.
        keys: sparse field names of each Batch part (one for a Batch, support and query
            for a TaskBatch).
        slots: per tensor, ``(byte offset, dtype, shape)`` or None if absent.
        nbytes: buffer size in bytes.
        field_counts: per Batch part, each sparse field's number of ids counted on the
            host (None where the offsets are malformed): the unpacked batch knows them
            without reading the device (:attr:`SparseFeatures.known_field_counts`).
    """

    kind: str
    keys: tuple[tuple[str, ...], ...]
    slots: tuple[tuple[int, torch.dtype, tuple[int, ...]] | None, ...]
    nbytes: int
    field_counts: tuple[tuple[int, ...] | None, ...]


def batch_tensors(batch: Batch | TaskBatch) -> tuple[str, list[tuple[str, ...]], list[Tensor | None]]:
    """(kind, keys per Batch part, every tensor slot in order)."""
    if isinstance(batch, TaskBatch):
        parts = [batch.support, batch.query]
        extra = [batch.support_mask, batch.query_mask, batch.task_ids]
        kind = "task_batch"
    elif isinstance(batch, Batch):
        parts, extra, kind = [batch], [], "batch"
    else:
        raise TypeError(f"cannot pack {type(batch).__name__}; expected Batch or TaskBatch")
    tensors: list[Tensor | None] = []
    for b in parts:
        s = b.sparse
        # Implicit (one-hot) offsets are no slot: unpack makes them on the device.
        tensors += [b.dense, b.labels, b.weights, s.values, s.explicit_offsets, s.weights]
    return kind, [tuple(b.sparse.keys) for b in parts], tensors + extra


def layout_of(batch: Batch | TaskBatch) -> Layout:
    """The packed layout of a CPU ``batch`` (offsets aligned to :data:`ALIGN`), with its
    sparse fields' id counts (one pass over each part's offsets)."""
    kind, keys, tensors = batch_tensors(batch)
    parts = [batch.support, batch.query] if isinstance(batch, TaskBatch) else [batch]
    counts = tuple(part.sparse.count_fields_on_host() for part in parts)
    slots = []
    offset = 0
    for t in tensors:
        if t is None:
            slots.append(None)
            continue
        slots.append((offset, t.dtype, tuple(t.shape)))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return Layout(kind, tuple(keys), tuple(slots), offset, counts)


def pack(
    batch: Batch | TaskBatch,
    out: Tensor | None = None,
    *,
    pin_memory: bool = False,
    layout: Layout | None = None,
) -> tuple[Tensor, Layout]:
    """Copies every tensor of a CPU ``batch`` into one uint8 buffer.

    Args:
        batch: the batch (CPU tensors).
        out: a uint8 CPU buffer of at least ``layout.nbytes`` bytes to fill (reused
            across batches); None = allocate one.
        pin_memory: allocate the new buffer in pinned memory.
        layout: ``layout_of(batch)`` when the caller has it already.

    Returns:
        (the buffer, possibly a prefix view of ``out``; the layout).
    """
    layout = layout_of(batch) if layout is None else layout
    if out is None or out.numel() < layout.nbytes:
        out = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, pin_memory=pin_memory)
    buf = out[: layout.nbytes]
    _, _, tensors = batch_tensors(batch)
    for t, slot in zip(tensors, layout.slots):
        if slot is not None and t.numel():
            _view(buf, slot).copy_(t)
    return buf, layout


def unpack(buf: Tensor, layout: Layout) -> Batch | TaskBatch:
    """Rebuilds the batch from views of ``buf`` (a uint8 buffer with the packed bytes)."""
    views = [None if slot is None else _view(buf, slot) for slot in layout.slots]
    parts = []
    for i, (keys, counts) in enumerate(zip(layout.keys, layout.field_counts, strict=True)):
        dense, labels, weights, values, offsets, sw = views[i * _BATCH_SLOTS : (i + 1) * _BATCH_SLOTS]
        sparse = SparseFeatures(list(keys), values, offsets, sw).remember_field_counts(counts)
        parts.append(Batch(dense, sparse, labels, weights))
    if layout.kind == "batch":
        return parts[0]
    smask, qmask, ids = views[len(layout.keys) * _BATCH_SLOTS :]
    return TaskBatch(parts[0], parts[1], smask, qmask, ids)


def _view(buf: Tensor, slot: tuple[int, torch.dtype, tuple[int, ...]]) -> Tensor:
    offset, dtype, shape = slot
    size = torch.Size(shape).numel() * dtype.itemsize
    return buf[offset : offset + size].view(dtype).view(shape)
