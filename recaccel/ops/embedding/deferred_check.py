"""The deferred bounds check's host side (``bounds_check="deferred"`` of
:class:`~recaccel.ops.embedding.module.PackedEmbeddingBag`): the batch's offsets made safe
for the kernels without a host sync, and the bad-id count on its way to the host.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from recaccel.ops.embedding.bounds_check import check_batch
from recaccel.ops.embedding.packing import PackingPlan, Routing
from recaccel.ops.embedding.prepared import PreparedSparse
from recaccel.ops.embedding.specs import InvalidIdError
from recaccel.sparse import SparseFeatures

_OP = "PackedEmbeddingBag"


@dataclasses.dataclass
class PendingCheck:
    """A looked-up batch whose bad-id count is on its way to the host.

    Attributes:
        batch: The batch as given to :meth:`PackedEmbeddingBag.prepare` (re-checked
            eagerly, for the message, when the count is non-zero).
        routing: Its routing.
        counter: The device counter (the batch's ``bad_ids``).
        host: The count's host copy (pinned on CUDA; the counter itself on CPU).
        event: Marks the copy's end on CUDA; None on CPU.
    """

    batch: SparseFeatures
    routing: Routing
    counter: Tensor
    host: Tensor
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, batch: SparseFeatures, routing: Routing, counter: Tensor) -> PendingCheck:
        """Starts the host's copy of ``counter``, the bad-id count of ``batch`` routed by ``routing``."""
        if not counter.is_cuda:
            return cls(batch, routing, counter, counter, None)
        host = torch.empty(counter.shape, dtype=counter.dtype, pin_memory=True)
        host.copy_(counter, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(batch, routing, counter, host, event)

    def landed(self) -> bool:
        return self.event is None or self.event.query()

    def bad(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        # numpy(): a read of host memory (it refuses a CUDA tensor), never a device sync.
        return int(self.host.numpy()[0]) > 0


def defer_batch_check(sf: SparseFeatures) -> tuple[SparseFeatures, Tensor]:
    """The batch with its offsets replaced by a valid CSR when they are not one (the same
    values when they are), and an int32 [1] counter holding 1 if they were not. No host sync."""
    if sf.one_hot:
        # Implicit offsets (one id a bag) are a valid CSR by construction: no offsets made
        # and no ~10 launches checking them (host time the step waits on in a sync pipeline).
        return sf, torch.zeros(1, dtype=torch.int32, device=sf.values.device)
    values, offsets = sf.values, sf.offsets
    n = values.numel()
    bad = (offsets[0] != 0) | (offsets[-1] != n) | (offsets[1:] < offsets[:-1]).any()
    counter = bad.to(torch.int32).reshape(1)
    # Valid offsets are left as they are; malformed ones become [0, ..., 0, n] (every id in
    # the last bag, a valid CSR), so that no kernel reads outside the ids before the error
    # is raised. A select, not torch.cummax: CUDA scans a 1-D tensor in one thread block
    # (milliseconds for criteo's 1.7 M offsets: the 4 ms "prepare" block of the H200
    # timeline, 2026-11-26). No item assignment either: a Python number written into a
    # CUDA tensor goes through a pageable copy, which synchronizes with the host.
    fallback = torch.zeros_like(offsets)
    fallback[-1:].fill_(n)
    safe = torch.where(bad, fallback, offsets)
    # Known field counts were counted from a valid CSR (which passes as it is).
    return sf.with_tensors(values, safe, sf.weights), counter


class PendingChecks:
    """A module's looked-up batches whose bad-id counts are on their way to the host.

    Args:
        plan: The module's packing plan (for the eager re-check's message).
    """

    def __init__(self, plan: PackingPlan) -> None:
        self._plan = plan
        self._pending: list[PendingCheck] = []

    def queue(self, sf: PreparedSparse) -> None:
        """Starts the host's copy of a looked-up batch's bad-id count (no waiting)."""
        if sf.bad_ids is None:
            return
        # A batch looked up again (micro-batches) replaces its earlier copy: the count grew.
        self._pending = [c for c in self._pending if c.counter is not sf.bad_ids]
        self._pending.append(PendingCheck.start(sf.unchecked, sf.routing, sf.bad_ids))

    def queue_count(self, batch: SparseFeatures, routing: Routing, counter: Tensor) -> None:
        """Starts the host's copy of ``counter``, the bad-id count of ``batch`` (not a
        preparation's own: a captured step's, copied out after its replay)."""
        self._pending.append(PendingCheck.start(batch, routing, counter))

    def raise_bad(self, wait: bool) -> None:
        """Raises for the first pending batch whose count arrived non-zero; keeps the
        batches whose copy has not landed yet (all of them land when ``wait``).

        Raises:
            InvalidIdError: the eager check's error for that batch.
        """
        pending, self._pending = self._pending, []
        for i, check in enumerate(pending):
            if not wait and not check.landed():
                self._pending.append(check)
                continue
            if check.bad():
                self._pending += pending[i + 1 :]
                check_batch(check.batch, check.routing, self._plan)
                raise InvalidIdError(
                    f"{_OP}: the lookup kernels counted out-of-range ids in features {list(check.batch.keys)}"
                )
