"""A host pack's preparation of a batch: the batch rewritten over cache slots, its lock,
and what the inner pack prepared for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from recaccel.ops.embedding.cache.slots import Ticket
from recaccel.ops.embedding.packing import PackRoute
from recaccel.ops.embedding.prepared import PackBatch, PreparedPack
from recaccel.sparse import SparseFeatures


@dataclasses.dataclass(kw_only=True)
class CachedPrepared(PreparedPack):
    """A host pack's preparation of a batch.

    Attributes:
        ids: The pack's ids with each row replaced by its slot, in CSR over S*B bags, the
            per-id weights unscaled (the ids of ``batch``).
        groups: The inner pack's row grouping (over slots) for the backward, or None.
        batch: The pack's features as a batch of S features whose ids are slots.
        route: ``batch``'s route: identity, no row shift.
        inner: The inner pack's preparation of ``batch``, or None.
        ticket: The lock on the batch's slots.
        source: The pack's inputs as the module gave them to ``prepare`` (to prepare
            them again); ``source.train``: prepared for training.
        ready: CUDA: the event after the preparation's copies; None on the CPU.
    """

    batch: SparseFeatures
    route: PackRoute
    inner: PreparedPack | None
    ticket: Ticket
    source: PackBatch
    ready: Any = None

    @property
    def train(self) -> bool:
        """Prepared for training."""
        return self.source.train

    def inner_batch(self, train: bool) -> PackBatch:
        """The inner pack's inputs: the slot batch with its preparation."""
        return PackBatch(self.batch, self.route, self.source.batch_size, train, self.inner)

    def own_tensors(self) -> Iterator[Tensor]:
        """The tensors this preparation made (what a consumer stream must mark used)."""
        yield from (t for t in (self.batch.values, self.batch.offsets, self.batch.weights) if t is not None)
        yield self.ticket.slots
        if self.inner is not None:
            yield from self.inner.tensors()


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` name one device: ``cuda`` and ``cuda:0`` do when device 0 is
    the current one (``torch.device`` equality compares the index as written)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None and b.index is None:
        return True
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
