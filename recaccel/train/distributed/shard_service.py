"""Stateful dynamic data sharding (``parallel.data = "dynamic"``), as AntDT's shard service.

An epoch's row groups are cut into small shards of ``data.shard_row_groups`` consecutive
row groups (file order), taken in an order permuted by ``(seed, epoch)`` when shuffling.
The shard *service* is the process group's store, hosted by rank 0: one atomic counter
per epoch (``store.add``) hands the next shard of the epoch's queue to whichever rank
asks first, so a fast rank reads more shards than a slow one. Each rank cuts its own
batches of ``data.batch_size`` rows from the shards it got (rows permuted within a shard
by ``(seed, epoch, shard)``); the hybrid step's agreement ends the epoch for every rank
when one has no shard left.

Shard states (the *ledger*): a shard is ``done`` (all its rows trained), ``in progress``
with its row offset (the rows before it trained), or ``pending``. A rank's reader state
is the ledger it started from updated with what it trained itself; the hybrid checkpoint
merges every rank's (:func:`merge_ledgers`: done anywhere is done, else the furthest
offset) so each rank's entry holds the epoch's whole ledger. A resume, with any number
of ranks, queues the in-progress shards (at their offsets) and then the pending ones:
every row is trained exactly once per epoch, whatever rank failed and whenever. Shards
handed out but not yet trained at the checkpoint (read ahead) are pending in it.

Rows left over when an epoch ends (an in-progress remainder of a rank when another ran
dry, or a short last batch with ``drop_last``) stay in progress in the final ledger.

::

    shards  s0=[g0] s1=[g1] ... s7=[g7]        queue (seed, epoch) -> s3 s0 s6 ...
    store.add("…/next", 1) -> 1: rank 1 reads s3;  -> 2: rank 0 reads s0; ...
    state   {"epoch": 0, "done": [3], "offsets": {"0": 256}, "num_shards": 8, ...}
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from recaccel.errors import ConfigError, DataError
from recaccel.io.format.columns import Columns
from recaccel.io.format.dataset import RowGroupReader, RowGroupRef, row_group_reader
from recaccel.io.format.decode import new_decode_stats
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.state import are_counters, set_counters, with_last
from recaccel.sparse import Batch
from recaccel.train.distributed.collectives import CollectiveError

_VERSION = 1
_COUNTERS = ("rows_yielded", "batches_yielded")


def shard_ranges(num_row_groups: int, per_shard: int) -> list[range]:
    """The shards of ``num_row_groups`` row groups: consecutive ranges of ``per_shard``
    (the last may be shorter)."""
    if per_shard < 1:
        raise ConfigError(f"data.shard_row_groups must be >= 1, got {per_shard}")
    return [range(s, min(s + per_shard, num_row_groups)) for s in range(0, num_row_groups, per_shard)]


def gathered_ledger(state: dict[str, Any], world_size: int) -> dict[str, Any]:
    """This rank's reader ``state`` with every rank's dynamic shard ledger merged in (each
    rank's checkpoint entry then holds the epoch's whole ledger; all ranks call it)."""
    import torch.distributed as dist

    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, state)
    return merge_ledgers(states)


def merge_ledgers(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The epoch's ledger from every rank's reader state (same epoch and settings): a
    shard done on any rank is done, else its offset is the furthest any rank reached.

    Raises:
        ConfigError: states of different epochs or settings.
    """
    first = states[0]
    keys = ("epoch", "num_shards", "seed", "shuffle", "shard_row_groups")
    for s in states[1:]:
        if any(s.get(k) != first.get(k) for k in keys):
            raise ConfigError(
                f"dynamic shard states disagree: {[{k: x.get(k) for k in keys} for x in states]}"
            )
    done = sorted({int(d) for s in states for d in s["done"]})
    offsets: dict[str, int] = {}
    for s in states:
        for shard, offset in s["offsets"].items():
            if int(shard) not in done:
                offsets[shard] = max(offsets.get(shard, 0), int(offset))
    counters: dict[str, int] = {}
    for s in states:
        for k, v in s.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
    return {
        **first,
        "done": done,
        "offsets": dict(sorted(offsets.items(), key=lambda kv: int(kv[0]))),
        "epoch_done": all(s["epoch_done"] for s in states),
        "counters": counters,
    }


class ShardService:
    """Hands out indices of an epoch's shard queue over a ``torch.distributed`` store.

    Args:
        store: the process group's store (``dist.distributed_c10d._get_default_store()``),
            whose server rank 0 hosts; any ``Store`` (a ``HashStore`` in one process).
        rank: this rank, recorded as each taken shard's holder.
        world_size: the number of ranks asking.
        timeout_s: how long a rank waits for the others' requests (see :meth:`take`).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float = 300.0) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        # A torchrun elastic restart may keep the agent's store, and one process group may
        # serve several runs: each rank counts the services it made (the same on every rank).
        base = f"recaccel/shards/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._prefix = f"{base}/{int(store.add(f'{base}/services/{rank}', 1))}"

    def take(self, round_id: str, queue_length: int, taken: int | None) -> int | None:
        """The next queue index of round ``round_id`` (the same on every rank), or None
        when the queue is exhausted.

        Ranks step together on equal batches, so a rank reading ahead must not hoard
        shards the others would train: it takes its ``taken + 1``-th shard of the round
        once the ranks have asked ``world_size * taken`` times (or the queue is out).
        ``taken = None``: no such wait (ranks of unequal batches take as they need).

        Raises:
            CollectiveError: the other ranks did not ask within ``timeout_s``.
        """
        key = f"{self._prefix}/{round_id}/next"
        deadline = time.monotonic() + self.timeout_s
        while taken is not None and (asked := int(self.store.add(key, 0))) < min(
            self.world_size * taken, queue_length
        ):
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"rank {self.rank}: the shard service saw {asked} shard requests, waiting for "
                    f"{self.world_size * taken} within {self.timeout_s:g}s (a rank stopped reading)"
                )
            time.sleep(0.005)
        index = int(self.store.add(key, 1)) - 1
        if index >= queue_length:
            return None
        self.store.set(f"{self._prefix}/{round_id}/holder/{index}", str(self.rank))
        return index


class DynamicShardReader:
    """A :class:`~recaccel.io.readers.protocol.Reader` of the shards the service hands
    this rank (see the module docstring); batches of ``base.batch_size`` rows.

    Args:
        base: a single-process :class:`BatchReader` giving the dataset, projection,
            batch size and read options (its own iteration is not used).
        service: the shard service shared by the ranks.
        shard_row_groups: row groups per shard.
        ragged: batches of :attr:`batch_rows` rows, which may change between batches (the
            straggler controller's sizes, ``parallel.straggler = "backup"``); shards are taken
            as this rank needs them, not in step with the others, and the epoch's last
            partial batch is yielded whatever ``drop_last`` (ranks may differ in batch size).

    Raises:
        ConfigError: ``base`` is not a BatchReader (meta-learning's tasks are not sharded
            dynamically).
    """

    def __init__(
        self, base: Any, service: ShardService, shard_row_groups: int, *, ragged: bool = False
    ) -> None:
        if not isinstance(base, BatchReader):
            raise ConfigError("parallel.data=dynamic reads rows (train.mode=dlrm); use parallel.data=global")
        self.base = base
        self.service = service
        self.shards = shard_ranges(len(base.info.row_groups), shard_row_groups)
        self.shard_row_groups = shard_row_groups
        self.ragged = ragged
        self.batch_rows = base.batch_size  # read at every cut (the loader thread cuts ahead)
        self.counters: dict[str, int] = new_decode_stats()
        self.counters.update(dict.fromkeys(_COUNTERS, 0))
        self._rounds = 0  # iterations so far: every rank iterates in step, so round ids agree
        self._state = self._fresh(0)

    @property
    def epoch(self) -> int:
        s = self._state
        return s["epoch"] + 1 if s["epoch_done"] else s["epoch"]

    @property
    def num_batches(self) -> int:
        """Batches per epoch per rank when shards split evenly (for a progress bar)."""
        rows = self.base.info.num_rows // self.service.world_size
        return rows // self.base.batch_size

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        self._state = self._fresh(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {**self._state, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at a ledger (one rank's state or :func:`merge_ledgers`' of all).

        Raises:
            ConfigError: a malformed state, or one taken with other settings.
            DataError: one taken on a dataset with another number of row groups.
        """
        if not isinstance(state, dict) or state.get("version") != _VERSION or state.get("kind") != "dynamic":
            raise ConfigError(f"dynamic shard state must be a dict with version {_VERSION}, got {state!r}")
        fresh = self._fresh(0)
        if state.get("num_shards") != fresh["num_shards"]:
            raise DataError(
                f"shard state was saved with num_shards={state.get('num_shards')!r}, "
                f"but this dataset has {fresh['num_shards']}"
            )
        for key in ("seed", "shuffle", "shard_row_groups"):
            if state.get(key) != fresh[key]:
                raise ConfigError(
                    f"shard state was saved with {key}={state.get(key)!r}, this run has {fresh[key]!r}"
                )
        n = fresh["num_shards"]
        done, offsets = state.get("done"), state.get("offsets")
        if not (
            isinstance(done, list)
            and all(isinstance(d, int) and 0 <= d < n for d in done)
            and isinstance(offsets, dict)
            and all(k.isdigit() and int(k) < n and isinstance(v, int) and v >= 0 for k, v in offsets.items())
            and isinstance(state.get("epoch"), int)
        ):
            raise ConfigError(f"dynamic shard state has a bad ledger: {state!r}")
        if "counters" in state:
            if not are_counters(state["counters"]):
                raise ConfigError(f"dynamic shard state has bad counters: {state['counters']!r}")
            set_counters(self.counters, state["counters"])
        self._state = {
            **fresh,
            "epoch": state["epoch"],
            "done": sorted(done),
            "offsets": dict(offsets),
            "epoch_done": bool(state.get("epoch_done", False)),
        }

    def queue(self, state: dict[str, Any]) -> list[tuple[int, int]]:
        """The epoch's (shard, start row) queue: in-progress shards first, then pending."""
        n = len(self.shards)
        if self.base.options.shuffle:
            order = np.random.default_rng([self.base.options.seed, state["epoch"], 0]).permutation(n)
        else:
            order = np.arange(n)
        done, offsets = set(state["done"]), state["offsets"]
        started = [(int(s), offsets[str(s)]) for s in order if str(s) in offsets and s not in done]
        pending = [(int(s), 0) for s in order if str(s) not in offsets and s not in done]
        return started + pending

    def __iter__(self) -> Iterator[Batch]:
        for batch, _ in self.iter_with_state():
            yield batch

    def iter_with_state(self) -> Iterator[tuple[Batch, dict[str, Any]]]:
        """This rank's batches from the shards it is handed, each with the ledger after it."""
        if self._state["epoch_done"]:
            self._state = self._fresh(self._state["epoch"] + 1)
        start = self._state
        self._rounds += 1
        cuts = self._cut(start, f"{start['epoch']}/{self._rounds}")
        try:
            for (batch, state), last in with_last(cuts):
                self._state = {**state, "epoch_done": last}
                yield batch, self.state_dict()
            self._state = {**self._state, "epoch_done": True}
        finally:
            cuts.close()

    def _cut(self, start: dict[str, Any], round_id: str) -> Iterator[tuple[Batch, dict[str, Any]]]:
        queue = self.queue(start)
        done, offsets = list(start["done"]), dict(start["offsets"])
        base = self.base
        source = row_group_reader(base.schema, base.projection, base.policies, self.counters, base.info.cache)
        carry: list[Columns] = []
        carried: list[int] = []  # shards whose remaining rows are all in the carry
        carry_rows = 0
        try:
            taken = 0
            # ragged: no lockstep (ranks consume at different rates; dry ranks wait in empty steps)
            while (
                index := self.service.take(round_id, len(queue), None if self.ragged else taken)
            ) is not None:
                taken += 1
                shard, i = queue[index]
                cols = self._read(source, shard)
                n = cols.num_rows
                if i > n:
                    raise DataError(
                        f"shard {shard} resumes at row {i} but has {n} rows; did the data change?"
                    )
                order = self._order(start["epoch"], shard, n)
                while n - i >= (need := max(self.batch_rows - carry_rows, 0)):
                    j = i + need
                    batch = Columns.concat([*carry, cols.take(order[i:j])]).to_batch()
                    i = j
                    done += carried
                    carry, carried, carry_rows = [], [], 0
                    if i < n:
                        offsets[str(shard)] = i
                    else:
                        done.append(shard)
                        offsets.pop(str(shard), None)
                    for s in done:
                        offsets.pop(str(s), None)
                    self.counters["rows_yielded"] += batch.batch_size
                    self.counters["batches_yielded"] += 1
                    yield batch, {**start, "done": sorted(done), "offsets": dict(offsets)}
                if i < n:
                    carry.append(cols.take(order[i:n]))
                    carried.append(shard)
                    carry_rows += n - i
            if carry_rows and (self.ragged or not self.base.options.drop_last):
                batch = Columns.concat(carry).to_batch()
                done += carried
                for s in carried:
                    offsets.pop(str(s), None)
                self.counters["rows_yielded"] += batch.batch_size
                self.counters["batches_yielded"] += 1
                yield batch, {**start, "done": sorted(done), "offsets": dict(offsets)}
        finally:
            source.close()

    def _read(self, source: RowGroupReader, shard: int) -> Columns:
        refs: list[RowGroupRef] = [self.base.info.row_groups[g] for g in self.shards[shard]]
        return Columns.concat([source.read(ref) for ref in refs])

    def _order(self, epoch: int, shard: int, n: int) -> np.ndarray:
        if not self.base.options.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.base.options.seed, epoch, 1, shard]).permutation(n)

    def _fresh(self, epoch: int) -> dict[str, Any]:
        o = self.base.options
        return {
            "version": _VERSION,
            "kind": "dynamic",
            "epoch": epoch,
            "num_shards": len(self.shards),
            "shard_row_groups": self.shard_row_groups,
            "seed": o.seed,
            "shuffle": o.shuffle,
            "done": [],
            "offsets": {},
            "epoch_done": False,
        }


__all__ = ["DynamicShardReader", "ShardService", "merge_ledgers", "shard_ranges"]
