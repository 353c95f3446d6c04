"""The device cache's bookkeeping: the id -> slot map, slot -> row, and the slots' locks.

A pack of R rows cached in C slots keeps, on the cache's device:

- ``slot_of`` int32 [R]: the slot holding each packed row, -1 when the row is not resident;
- ``row_of`` int64 [C]: the row each slot holds, -1 for an empty slot;
- ``locks`` int32 [C]: how many batches of the window need the slot's row (a locked slot is
  never reused);
- ``last_use`` int64 [C], ``freq`` int64 [C]: the victim policy's counters
  (:mod:`recaccel.ops.embedding.cache.policy`);
- ``dirty`` bool [C]: the row (or its optimizer state) was updated since it was fetched,
  so it must be written back to the host before its slot is reused.

Locks follow a window of tickets (:class:`LockWindow`): every preparation of a batch takes
a ticket that locks its unique rows' slots. A training ticket is released when ``window``
newer training tickets have been taken (just before the ``window``-th is) (a FIFO: a batch prepared ahead stays resident
until it has been trained, as long as no more than ``window`` batches are in flight); an
evaluation ticket when its lookup has been queued, or when ``window`` newer evaluation
tickets have been taken, whichever comes first. A released ticket's batch may have lost
its rows: the pack makes them resident again before using it.

Shapes: R packed rows, C slots, U unique rows of a batch.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(eq=False)
class Ticket:
    """One preparation's lock on its slots.

    Attributes:
        seq: The preparation count when it was taken.
        slots: int64 [U] the slots it locks (unique).
        train: Taken by a training preparation.
        released: Released: its batch no longer counts on its slots (they may be reused
            once its locks are given back).
        unlocked: Its locks were given back.
    """

    seq: int
    slots: Tensor
    train: bool
    released: bool = False
    unlocked: bool = False


class SlotTable:
    """The map and the per-slot counters of one pack's cache (see the module docstring).

    Args:
        num_rows: R.
        capacity: C.
        device: The cache's device.
    """

    def __init__(self, num_rows: int, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.slot_of = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.locks = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.last_use = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.freq = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.clock = 0  # preparations so far

    def lookup(self, rows: Tensor) -> Tensor:
        """int64 [U] slot of each row, -1 where not resident."""
        return self.slot_of.index_select(0, rows).long()

    def assign(self, rows: Tensor, slots: Tensor, evicted_rows: Tensor) -> None:
        """Records that ``rows`` [K] now live in ``slots`` [K] (fresh, clean), whose previous
        rows ``evicted_rows`` (the non-empty ones) are no longer resident."""
        self.slot_of.index_fill_(0, evicted_rows, -1)
        self.slot_of.index_copy_(0, rows, slots.to(torch.int32))
        self.row_of.index_copy_(0, slots, rows)
        self.dirty.index_fill_(0, slots, False)
        self.freq.index_fill_(0, slots, 0)

    def take(self, slots: Tensor, train: bool) -> Ticket:
        """Locks ``slots`` (unique) for a new preparation and counts their request."""
        self.clock += 1
        self.locks.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        self.last_use.index_fill_(0, slots, self.clock)
        self.freq.index_add_(0, slots, torch.ones_like(slots))
        return Ticket(self.clock, slots, train)

    def unlock(self, ticket: Ticket) -> None:
        """Releases a ticket and gives its locks back (once)."""
        ticket.released = True
        if not ticket.unlocked:
            ticket.unlocked = True
            self.locks.index_add_(0, ticket.slots, torch.full_like(ticket.slots, -1, dtype=torch.int32))

    def resident(self) -> tuple[Tensor, Tensor]:
        """(slots, rows) of every occupied slot, ascending slots."""
        slots = torch.nonzero(self.row_of >= 0).squeeze(1)
        return slots, self.row_of.index_select(0, slots)


class LockWindow:
    """The tickets in force: a FIFO of ``window`` training tickets and one of ``window``
    evaluation tickets (see the module docstring).

    Args:
        table: The slots the tickets lock.
        window: Tickets of each kind kept.
    """

    def __init__(self, table: SlotTable, window: int) -> None:
        self.table = table
        self.window = window
        self._fifos = {True: collections.deque(), False: collections.deque()}
        self._deferred: list[Ticket] = []

    def make_room(self, train: bool) -> None:
        """Before a preparation of that kind: unlocks the oldest tickets of the kind until
        ``window - 1`` remain, so that with the new one ``window`` batches are locked."""
        fifo = self._fifos[train]
        while len(fifo) >= self.window:
            self.table.unlock(fifo.popleft())

    def push(self, ticket: Ticket) -> None:
        """Adds a taken ticket (after :meth:`make_room`)."""
        self._fifos[ticket.train].append(ticket)

    def release(self, ticket: Ticket) -> None:
        """Releases one ticket now (its evaluation lookup has been queued); its locks are
        given back by the next :meth:`settle`, where every other change of the locks is
        made (on CUDA: the cache's copy stream)."""
        ticket.released = True
        fifo = self._fifos[ticket.train]
        if ticket in fifo:
            fifo.remove(ticket)
            self._deferred.append(ticket)

    def settle(self) -> None:
        """Gives back the locks of the tickets released since the last call."""
        for ticket in self._deferred:
            self.table.unlock(ticket)
        self._deferred.clear()

    def locked_batches(self) -> int:
        """Tickets holding locks."""
        return sum(len(f) for f in self._fifos.values()) + len(self._deferred)
