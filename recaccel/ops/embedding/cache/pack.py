"""A host-placed pack: full rows in host memory, a device cache driven by the prepared batches.

:class:`CachedPack` is the :class:`~recaccel.ops.embedding.pack_backend.PackBackend` of a
pack whose tables are placed on the host. It keeps:

- the pack's rows and optimizer state in host memory
  (:class:`~recaccel.ops.embedding.cache.host_store.HostStore`, pinned on CUDA);
- a device cache of C rows with their optimizer state, held by an inner pack of the
  module's backend (reference or Triton) built for C rows;
- the id -> slot map and the slots' counters and locks
  (:mod:`~recaccel.ops.embedding.cache.slots`).

``prepare`` makes a batch's unique rows resident: rows already in a slot are hits; the
others take the first unlocked slots of the victim order
(:mod:`~recaccel.ops.embedding.cache.policy`), whose dirty rows are written back first;
the missing rows are gathered on the host into a staging buffer and copied in one
transfer. The batch's rows are locked by a ticket (released per the window rule of
:mod:`~recaccel.ops.embedding.cache.slots`). The pack's ids are then rewritten as a
batch of the pack's S features whose ids are slots, and the inner pack prepares,
looks up and updates that batch on the cache tensors with its unchanged kernels.

Exactness: every id reads and updates its own row's current values; only where they sit
changes. The kernels pool each bag's ids in the same order and the fused update sums each
row's occurrences in the same (stable) order and applies the same per-row math, so a
host-placed pack gives the device-placed pack's results bit for bit on the CPU (Adam's
step counter is the inner pack's, one per pack, as on the device).

On CUDA every cache operation of a preparation runs on the pack's copy stream, after the
preparing stream and after the last queued use of the cache (lookups and updates record an
event): the write-back of a victim reads it after its last update, and a fetch overwrites
a slot after its last reader. The lookup's stream waits on the preparation's event and
marks its tensors used (``record_stream``).

A batch whose ticket has been released (more than ``window`` newer batches prepared, or an
evaluation batch already looked up) is made resident again where it is used (lookup,
micro-batch lookup, deferred update, or just before the fused update of its backward):
slower, still exact.

Checkpoints: :meth:`CachedPack.table_tensors` writes the dirty rows back and returns the
host tensors (whole tables, the layout of a device pack); the cache is then refreshed from
the host before its next use, so writes into those tensors (``load_state_dict``) are seen.

Shapes: B batch, S features of the pack, N_p ids, U unique rows, R rows, C slots, D dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.ops.embedding.cache.counters import CacheCounters
from recaccel.ops.embedding.cache.host_store import HostStore
from recaccel.ops.embedding.cache.options import CacheOptions
from recaccel.ops.embedding.cache.policy import victim_order
from recaccel.ops.embedding.cache.prepared import CachedPrepared, same_device
from recaccel.ops.embedding.cache.slots import LockWindow, SlotTable, Ticket
from recaccel.ops.embedding.pack_backend import HeldPack, PackOptions, table_views
from recaccel.ops.embedding.packing import LocalFeatures, PackIds, PackLayout, PackRoute, gather_pack_ids
from recaccel.ops.embedding.prepared import PackBatch
from recaccel.sparse import SparseFeatures

_OP = "PackedEmbeddingBag"


class CachedPack:
    """One host-placed pack (see the module docstring).

    Built by :meth:`create`; the module holds none of its tensors (``.to()`` does not move
    them: build the module on its final device).

    Args:
        layout: The pack (``placement == "host"``).
        weights: Initial float32 [R_t, D] rows of each table (CPU).
        options: The module's settings (fused mode, float32 rows).
        device: The cache's device.
        inner_class: The backend's pack class (reference or Triton).
        cache: The cache's size, policy and window.
    """

    always_checks_ids = True  # ids index the id -> slot map

    def __init__(
        self,
        layout: PackLayout,
        weights: list[Tensor],
        options: PackOptions,
        device: torch.device,
        inner_class: type[HeldPack],
        cache: CacheOptions,
    ) -> None:
        self.layout = layout
        self.device = device
        self.policy = cache.policy
        self.capacity = cache.capacity(layout.num_rows)
        self.store = HostStore(layout, weights, device, self.capacity)
        self._inner_class, self._options = inner_class, options  # to build the cache again (resize)
        self.inner, self.cache = self._new_cache(self.capacity)
        self.table = SlotTable(layout.num_rows, self.capacity, device)
        self.window = LockWindow(self.table, cache.window)
        self.counters = CacheCounters()
        self._stale = False  # the host tensors may differ from the resident rows
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._uses: dict[int, torch.cuda.Event] = {}  # per stream: its last queued use of the cache
        self._virtual: dict[int, tuple[Tensor, Tensor]] = {}  # S -> (arange(S), zeros(S))

    @classmethod
    def create(
        cls,
        layout: PackLayout,
        weights: list[Tensor],
        options: PackOptions,
        device: torch.device,
        *,
        inner_class: type[HeldPack],
        cache: CacheOptions,
    ) -> tuple[CachedPack, dict[str, Tensor]]:
        """The pack, and no tensors for the module to hold."""
        return cls(layout, weights, options, device, inner_class, cache), {}

    def _new_cache(self, capacity: int) -> tuple[HeldPack, dict[str, Tensor]]:
        """An inner pack of ``capacity`` rows and its (zero) cache tensors."""
        zeros = [torch.zeros(capacity, self.layout.dim)]
        inner_layout = dataclasses.replace(self.layout, num_rows=capacity)
        return self._inner_class.create(inner_layout, zeros, self._options, self.device)

    @torch.no_grad()
    def resize(self, capacity: int, window: int) -> None:
        """Empties the cache and gives it ``capacity`` slots and a window of ``window``
        training batches, between batches (before training starts, or after a pass that
        must leave no trace).

        Dirty rows are written back first; every row is then fetched again on demand,
        so results do not change. The staging buffers start over; the counters and
        the inner pack's step and learning rate are kept.

        Raises:
            ValueError: a capacity outside ``1..R`` or a window below 1.
        """
        if not 1 <= capacity <= self.layout.num_rows or window < 1:
            raise ValueError(
                f"{_OP}: cache of {capacity} rows / window {window} (pack of {self.layout.num_rows})"
            )
        self.flush()
        step, optim = self.inner.step, self.inner.optim
        self.inner, self.cache = self._new_cache(capacity)
        self.inner.step, self.inner.optim = step, optim  # Adam's t and the rate outlive the slots
        self.capacity = self.store.capacity = capacity
        self.store.reset_staging()
        self.table = SlotTable(self.layout.num_rows, capacity, self.device)
        self.window = LockWindow(self.table, window)
        self._stale = False  # nothing resident: every row comes from the host
        self._uses.clear()

    # ----------------------------------------------------------------- PackBackend

    def check_batch_device(self, held: Mapping[str, Tensor], device: torch.device) -> None:
        if not same_device(device, self.device):
            raise ValueError(f"{_OP}: the batch is on {device} but the tables' cache is on {self.device}")

    def prepare(self, batch: PackBatch) -> CachedPrepared:
        """Makes the batch's rows resident and locked, and rewrites its ids as slots."""
        sf, route, batch_size = batch.sf, batch.route, batch.batch_size
        with torch.no_grad(), self._on_copy_stream(sf):
            self._refresh_if_stale()
            # Raw per-id weights: the inner pack applies a mean's 1/L itself, as on the device.
            base = gather_pack_ids(sf, dataclasses.replace(route.local, any_mean=False), batch_size)
            unique, inverse = torch.unique(base.rows, sorted=True, return_inverse=True)
            slots, ticket = self._acquire(unique.long(), batch.train)
            keys = [sf.keys[i] for i in route.features]
            # Slots < C <= R: they keep the ids' dtype, so int32 ids stay int32 in the cache.
            slot_ids = slots.index_select(0, inverse).to(base.rows.dtype)
            slot_batch = SparseFeatures(keys, slot_ids, base.offsets, base.scale)
            vroute = PackRoute(
                route.features, self._virtual_local(route.local), route.slots, route.slot_of_local
            )
            inner = self.inner.prepare(PackBatch(slot_batch, vroute, batch_size, batch.train))
            ready = None
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(self._stream)
        return CachedPrepared(
            ids=PackIds(slot_batch.values, slot_batch.offsets, slot_batch.weights, None),
            groups=None if inner is None else inner.groups,
            batch=slot_batch,
            route=vroute,
            inner=inner,
            ticket=ticket,
            source=dataclasses.replace(batch, prepared=None),
            ready=ready,
        )

    def lookup(self, held: Mapping[str, Tensor], batch: PackBatch) -> Tensor:
        train = batch.train
        ready = self._usable(batch)
        out = self.inner.lookup(self.cache, ready.inner_batch(train))
        if train and out.grad_fn is not None:
            # The fused update runs in this node's backward: its slots must still be this
            # batch's rows then, and they are dirty after it.
            out.grad_fn.register_prehook(functools.partial(self._before_update, ready))
            out.grad_fn.register_hook(functools.partial(self._after_update, ready))
        if not ready.train:
            self.window.release(ready.ticket)  # an evaluation batch: done with its rows
        self._used()
        return out

    def lookup_rows(
        self,
        held: Mapping[str, Tensor],
        batch: PackBatch,
        lo: int,
        hi: int,
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        prepared = batch.prepared
        train = isinstance(prepared, CachedPrepared) and prepared.train
        ready = self._usable(dataclasses.replace(batch, train=train))
        out = self.inner.lookup_rows(self.cache, ready.inner_batch(False), lo, hi, out_dtype)
        self._used()
        return out

    def deferred_update_unsupported(self) -> str | None:
        return self.inner.deferred_update_unsupported()

    def apply_gradient(self, held: Mapping[str, Tensor], batch: PackBatch, grad: Tensor) -> None:
        ready = self._usable(dataclasses.replace(batch, train=True))
        self.inner.apply_gradient(self.cache, ready.inner_batch(True), grad)
        self._after_update(ready)

    def table_tensors(self, held: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """Per table: views of the host rows [R_t, D] and optimizer state, after the dirty
        rows were written back; the cache reloads from them before its next use."""
        self.flush()
        self._stale = True
        return table_views(self.layout, self.store.tensors, self.inner.step)

    def set_learning_rate(self, lr: float) -> None:
        self.inner.set_learning_rate(lr)

    # --------------------------------------------------------------- cache upkeep

    @torch.no_grad()
    def flush(self) -> None:
        """Writes every dirty resident row (and its state) back to the host and waits for it."""
        with self._on_copy_stream(None):
            t = self.table
            slots = torch.nonzero(t.dirty & (t.row_of >= 0)).squeeze(1)
            rows = t.row_of.index_select(0, slots).cpu()
            self.counters.bytes_d2h += self.store.write_back(self.cache, slots, rows)
            self.store.complete_pending()
            t.dirty.fill_(False)

    def stats(self) -> dict[str, float]:
        """This pack's cache counters (cumulative) and sizes, by metric name."""
        c = self.counters
        return {
            "cache_hit_rate": c.hits / c.requests if c.requests else 0.0,
            "cache_requests": float(c.requests),
            "cache_hits": float(c.hits),
            "cache_rows_fetched": float(c.fetched),
            "cache_rows_evicted": float(c.evicted),
            "cache_bytes_h2d": float(c.bytes_h2d),
            "cache_bytes_d2h": float(c.bytes_d2h),
            "cache_staging_bytes": float(self.store.staging_bytes),
            "cache_rows": float(self.capacity),
        }

    def _acquire(self, unique: Tensor, train: bool) -> tuple[Tensor, Ticket]:
        """Makes ``unique`` rows [U] resident and locks them; returns their slots [U] and the ticket."""
        t = self.table
        self.window.make_room(train)
        self.window.settle()
        self.store.complete_pending()  # the host rows must be current before any gather
        slots = t.lookup(unique)
        hit = slots >= 0
        missing = unique[~hit]
        k = missing.numel()
        candidates = t.locks == 0
        candidates.index_fill_(0, slots[hit], False)
        victims = victim_order(self.policy, candidates, t.last_use, t.freq)[:k]
        if victims.numel() < k:
            raise self._too_small(unique.numel(), slots[hit])
        if k:
            old_rows = t.row_of.index_select(0, victims)
            dirty = t.dirty.index_select(0, victims) & (old_rows >= 0)
            host = torch.cat([missing, old_rows, dirty.long()]).view(3, k).cpu()  # one read for all three
            missing_h, old_h, dirty_h = host[0], host[1], host[2].bool()
            # Dirty victims go back first: the fetch below overwrites their slots (same stream).
            self.counters.bytes_d2h += self.store.write_back(self.cache, victims[dirty], old_h[dirty_h])
            self.counters.bytes_h2d += self.store.fetch(self.cache, missing_h, victims)
            t.assign(missing, victims, old_rows[old_rows >= 0])
            slots = slots.masked_scatter(~hit, victims)
            self.counters.fetched += k
            self.counters.evicted += int((old_h >= 0).sum())
        self.counters.requests += unique.numel()
        self.counters.hits += unique.numel() - k
        ticket = t.take(slots, train)
        self.window.push(ticket)
        return slots, ticket

    def _too_small(self, needed: int, hit_slots: Tensor) -> ConfigError:
        t = self.table
        mine = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        mine.index_fill_(0, hit_slots, True)
        others = int(((t.locks > 0) & ~mine).sum())
        names = [table.name for table in self.layout.tables]
        return ConfigError(
            f"{_OP}: the device cache of host tables {names} has {self.capacity} rows, but a batch needs "
            f"{needed} unique rows and the {self.window.locked_batches()} batches of the window lock {others} "
            "more; raise model.cache_rows / cache_fraction or lower model.cache_lookahead"
        )

    def _refresh_if_stale(self) -> None:
        """Reloads every resident row from the host after its tensors were handed out."""
        if not self._stale:
            return
        self._stale = False
        slots, rows = self.table.resident()
        self.store.complete_pending()
        rows = rows.cpu()
        self.counters.bytes_h2d += self.store.fetch(self.cache, rows, slots)
        self.counters.fetched += rows.numel()
        self.table.dirty.fill_(False)

    def _usable(self, batch: PackBatch) -> CachedPrepared:
        """``batch.prepared`` when its rows are still locked (and made for training if
        ``batch.train``), else the batch prepared again; the current stream then waits for it."""
        prepared = batch.prepared
        usable = (
            isinstance(prepared, CachedPrepared)
            and not prepared.ticket.released
            and (prepared.train or not batch.train)
        )
        ready = prepared if usable else self.prepare(dataclasses.replace(batch, prepared=None))
        self._wait(ready)
        return ready

    def _before_update(self, prepared: CachedPrepared, grad_outputs: Any) -> None:
        """Just before a fused backward's update: the batch's rows must still be in its slots."""
        if prepared.ticket.released:
            fresh = self.prepare(dataclasses.replace(prepared.source, train=True))
            # The backward reads the inner preparation it was given: update it in place.
            prepared.inner.take(fresh.inner)
            prepared.ticket, prepared.ready, prepared.batch = fresh.ticket, fresh.ready, fresh.batch
            prepared.ids, prepared.groups = fresh.ids, fresh.groups
        self._wait(prepared)

    def _after_update(self, prepared: CachedPrepared, *hook_args: Any) -> None:
        """After an update of the batch's rows: their slots are dirty."""
        self.table.dirty.index_fill_(0, prepared.ticket.slots, True)
        self._used()

    def _wait(self, prepared: CachedPrepared) -> None:
        """Makes the current stream wait for the preparation (and any refresh) and own its tensors."""
        refreshed = self._stale
        if refreshed:
            with torch.no_grad(), self._on_copy_stream(None):
                self._refresh_if_stale()
        if self._stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        # Its own event, not the whole copy stream: later batches' copies may be queued there.
        current.wait_event(prepared.ready)
        if refreshed:
            current.wait_stream(self._stream)
        for tensor in prepared.own_tensors():
            tensor.record_stream(current)

    def _used(self) -> None:
        """Records the current stream's last queued use of the cache (CUDA)."""
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            event = torch.cuda.Event()
            event.record(current)
            self._uses[current.stream_id] = event

    @contextlib.contextmanager
    def _on_copy_stream(self, sf: SparseFeatures | None) -> Iterator[None]:
        """CUDA: runs the block on the copy stream, after the current stream and after every
        queued use of the cache; CPU: runs it as is."""
        if self._stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        for event in self._uses.values():
            self._stream.wait_event(event)
        if sf is not None:
            for tensor in (sf.values, sf.offsets, sf.weights):
                if tensor is not None:
                    tensor.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            yield

    def _virtual_local(self, local: LocalFeatures) -> LocalFeatures:
        """The local features of the slot batch: feature j is the batch's feature j, no shift."""
        count = local.count
        if count not in self._virtual:
            self._virtual[count] = (
                torch.arange(count, dtype=torch.int64, device=self.device),
                torch.zeros(count, dtype=torch.int64, device=self.device),
            )
        src, shift = self._virtual[count]
        return LocalFeatures(
            src=src,
            row_offset=shift,
            is_mean=local.is_mean,
            count=count,
            identity=True,
            any_mean=local.any_mean,
            any_shift=False,
            any_missing=False,
        )
