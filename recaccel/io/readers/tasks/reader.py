"""Meta-IO task reader: TaskBatches of T tasks x (S support, Q query) rows from Parquet.

Input. A dataset sorted by task key (``recaccel-data tasks``, or a converter); see
:mod:`recaccel.io.readers.tasks.stream` for how tasks are found and the order verified.

Epoch order and sharding. The dataset's non-empty row groups, cut into units of
``unit_row_groups`` consecutive row groups, are permuted with an RNG seeded by
``(seed, epoch)`` when shuffling and dealt out: rank r takes the units at positions
``i % world_size == r`` of that list, and with them the tasks that *start* in their row
groups (a task crossing into the next row group is completed from it). Every task, and
every row, goes to exactly one rank; ranks may get unequal task counts. Inside a
``torch.utils.data.DataLoader`` with W > 1 workers, worker w of rank r reads shard
``r * W + w`` of ``world_size * W`` (the reader is an ``IterableDataset``).

Shuffle buffer. The rank's units are read in order into windows holding at least
``shuffle_buffer_tasks`` kept tasks (whole units); each window's tasks are permuted
with an RNG seeded by ``(seed, epoch, rank, window)`` and batches of T tasks are cut
from that order; tasks left at a window's end start the next batch. Without shuffle a
window is one unit and tasks come in key order.

Split and shapes (:mod:`recaccel.io.readers.tasks.split`). Training splits each task seeded by
``(seed, epoch)``, samples a side larger than S (support) or Q (query) down to S or Q
rows, and pads the rest: every batch has support T*S and query T*Q rows (the last one
may have fewer tasks unless ``drop_last``). Evaluation (``train=False``) keeps every
row: no shuffle, no sampling, the split seeded by ``seed`` alone, and each batch widens
S and Q to its largest task (never below the configured sizes), so every query row is
scored exactly once and per-task metrics see the whole query set.

Padding rows repeat the task's first row (valid ids, same bag structure); the masks
``support_mask`` / ``query_mask`` float32 [T, S] / [T, Q] mark real rows, and each
side's ``Batch.weights`` holds the same mask flattened ([T*S] / [T*Q]). In a batch
that starts with tasks carried over from the previous window, those come first.

Memory. A window holds the kept (split and sampled) rows of its units' tasks, which the
worker that loaded a unit copied out of its decoded row groups (see
:mod:`recaccel.io.readers.tasks.pool`): about ``shuffle_buffer_tasks`` plus one unit's worth of
tasks, plus up to T-1 carried tasks, the units being loaded ahead (``read_ahead``,
each with its decoded row groups and two cached ones); a task is assembled whole before
it is sampled. ``counters["max_buffered_rows"]`` is the high-water mark.

Position. As in :class:`~recaccel.io.readers.rows.BatchReader`: ``state_dict()`` is the
position after the last yielded batch: (epoch, window index, the window's first unit,
tasks of the window already consumed). Resuming rebuilds that window from its first
unit and yields exactly the remaining batches. The state carries the counters at its
position, less the counts of the window a resume loads again, and ``load_state_dict``
restores them. Decode counters (``rows_read``, ...)
count decodes: a row group decoded again to complete a task counts twice (this
happens when a unit is read before the unit its last task runs into; read after it,
the task's rows there were kept by that unit, see ``task_stream.HeadStash``); the task
and row counters count each task and row once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from recaccel.config import Config, DataConfig, TasksConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.dataset import DatasetInfo, open_dataset
from recaccel.io.format.decode import Policies, Projection, add_counts, new_decode_stats
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.readers.state import (
    check_reader_args,
    counters_at,
    data_fingerprint,
    data_shard,
    restore_counters,
    restore_position,
    with_last,
)
from recaccel.io.readers.tasks.pool import TaskPool, build_task_batch
from recaccel.io.readers.tasks.split import SPLIT_COUNTERS, SplitSpec
from recaccel.io.readers.tasks.stream import HeadStash, check_order, key_bounds, wanted_heads
from recaccel.io.readers.tasks.units import UnitLoader, UnitWorker
from recaccel.sparse import TaskBatch

_STATE_VERSION = 1


@dataclass(frozen=True)
class _Position:
    epoch: int
    window: int
    unit: int
    offset: int
    done: bool


@dataclass
class _Window:
    index: int
    unit_start: int
    unit_end: int
    pool: TaskPool
    counts: dict[str, int]  # counter increments of loading its units


class TaskReader(IterableDataset):
    """Iterable of CPU :class:`TaskBatch` es read from task-grouped Parquet (module doc).

    Args:
        path: a ``.parquet`` file or a directory of them, sorted by task key.
        cfg: T, S, Q, minimum task rows, split policy, query fraction, buffer size.
        schema: expected schema; None = the one stored in the files.
        columns: dense/sparse feature names to read; None = all.
        seed: base seed of shuffles, splits and sampling (>= 0).
        shuffle: shuffle row groups and tasks (training only).
        train: False = evaluation mode (every row kept; see the module docstring).
        rank: this process's shard, 0 <= rank < world_size.
        world_size: number of shards.
        drop_last: drop an epoch's last batch if it has fewer than T tasks.
        query_count: > 0: exactly this many query rows per task (the rest support),
            instead of ``cfg.query_fraction``. None = ``cfg.query_count`` if > 0, else
            ``cfg.query_size`` when ``cfg.query_fraction <= 0``, else 0.
        unit_row_groups: row groups per unit of shuffling and sharding. A unit's last
            task usually runs into the next row group, which is then decoded once
            more; longer units make that rarer.
        read_ahead: units decoded, split and compacted in advance, each on its own
            thread, while the current one is batched (see :mod:`recaccel.io.readers.tasks.units`);
            0 = none.
        invalid_ids, invalid_dense, invalid_labels: bad-value policies (see
            :mod:`recaccel.io.format.decode`).

    Attributes:
        info: the dataset footers.
        schema: the dataset schema.
        counters: decode counters plus ``tasks_read``, ``tasks_skipped_small``,
            ``rows_skipped_small``, ``tasks_subsampled``, ``rows_subsampled``,
            ``tasks_yielded``, ``rows_yielded`` (real rows), ``batches_yielded``,
            ``tasks_dropped_last``, ``row_groups_read`` and ``max_buffered_rows``.

    Raises:
        ConfigError: on bad arguments.
        DataError: if the data has no task key (or no timestamp for the time split),
            as :func:`open_dataset` does, and while iterating for unsorted or bad data.
    """

    def __init__(
        self,
        path: str | Path,
        cfg: TasksConfig,
        *,
        schema: FeatureSchema | None = None,
        columns: list[str] | tuple[str, ...] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        train: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        query_count: int | None = None,
        unit_row_groups: int = 4,
        read_ahead: int = 2,
        invalid_ids: str = "error",
        invalid_dense: str = "error",
        invalid_labels: str = "error",
    ) -> None:
        if cfg.tasks_per_batch < 1:
            raise ConfigError(f"tasks.tasks_per_batch must be >= 1, got {cfg.tasks_per_batch}")
        if cfg.shuffle_buffer_tasks < 1:
            raise ConfigError(f"tasks.shuffle_buffer_tasks must be >= 1, got {cfg.shuffle_buffer_tasks}")
        check_reader_args(seed=seed, rank=rank, world_size=world_size, read_ahead=read_ahead)
        if unit_row_groups < 1:
            raise ConfigError(f"unit_row_groups must be >= 1, got {unit_row_groups}")
        if query_count is None:
            query_count = cfg.query_count
            if query_count == 0 and cfg.query_fraction <= 0:
                query_count = cfg.query_size
        self.spec = SplitSpec(
            cfg.split,
            cfg.query_fraction,
            query_count,
            cfg.support_size,
            cfg.query_size,
            cfg.min_task_rows,
            train,
        )
        self.policies = Policies(invalid_ids, invalid_dense, invalid_labels)
        self.info: DatasetInfo = open_dataset(path, schema)
        self.schema = self.info.schema
        if self.schema.task_key is None:
            raise DataError(
                "the dataset has no task key column; group it with recaccel-data tasks", path=str(path)
            )
        if cfg.split == "time" and self.schema.timestamp is None:
            raise DataError(
                "tasks.split='time' needs a timestamp column; the dataset has none", path=str(path)
            )
        side = (self.schema.task_key,) + ((self.schema.timestamp,) if self.schema.timestamp else ())
        self.projection = Projection.select(self.schema, columns, side)
        self.cfg = cfg
        self.seed = seed
        self.train = train
        self.shuffle = shuffle and train
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last and train
        self.unit_row_groups = unit_row_groups
        self.read_ahead = read_ahead
        self._bounds = key_bounds(self.info, self.schema.task_key)
        check_order(self.info, *self._bounds, self.schema.task_key)
        self.counters: dict[str, int] = new_decode_stats()
        self.counters.update(dict.fromkeys(SPLIT_COUNTERS, 0))
        self.counters.update(
            tasks_yielded=0,
            rows_yielded=0,
            batches_yielded=0,
            tasks_dropped_last=0,
            row_groups_read=0,
            max_buffered_rows=0,
        )
        self._pos = _Position(0, 0, 0, 0, False)
        self._pos_counters = dict(self.counters)  # paired with _pos

    @classmethod
    def from_config(
        cls,
        path: str | Path,
        cfg: Config | TasksConfig,
        data_cfg: DataConfig | None = None,
        *,
        train: bool,
        rank: int = 0,
        world_size: int = 1,
        schema: FeatureSchema | None = None,
        columns: list[str] | tuple[str, ...] | None = None,
        query_count: int | None = None,
    ) -> TaskReader:
        """A reader configured by ``[tasks]`` and ``[data]`` (seed, shuffle, drop_last, policies).

        Args:
            cfg: the whole config, or its ``[tasks]`` section (then pass ``data_cfg``).
            data_cfg: the ``[data]`` section when ``cfg`` is a TasksConfig.
        """
        if isinstance(cfg, Config):
            tasks_cfg, data_cfg = cfg.tasks, cfg.data
        elif data_cfg is None:
            raise ConfigError("TaskReader.from_config needs the [data] section with a TasksConfig")
        else:
            tasks_cfg = cfg
        return cls(
            path,
            tasks_cfg,
            schema=schema,
            columns=columns,
            seed=data_cfg.seed,
            shuffle=data_cfg.shuffle,
            train=train,
            rank=rank,
            world_size=world_size,
            drop_last=data_cfg.drop_last,
            query_count=query_count,
            unit_row_groups=tasks_cfg.unit_row_groups,
            read_ahead=tasks_cfg.read_ahead,
            invalid_ids=data_cfg.invalid_ids,
            invalid_dense=data_cfg.invalid_dense,
            invalid_labels=data_cfg.invalid_labels,
        )

    @property
    def stats(self) -> dict[str, int]:
        """Deprecated alias of :attr:`counters` (read-only)."""
        return self.counters

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._pos.epoch + 1 if self._pos.done else self._pos.epoch

    def set_epoch(self, epoch: int) -> None:
        """Moves the position to the start of ``epoch``."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        self._pos = _Position(epoch, 0, 0, 0, False)
        self._pos_counters = dict(self.counters)

    def units(self, epoch: int, shard: tuple[int, int] | None = None) -> list[range]:
        """This rank's units (runs of ``unit_row_groups`` consecutive row groups, as
        indices into ``info.row_groups``) in read order.

        Args:
            epoch: the epoch.
            shard: (shard, shards) to read instead of (rank, world_size) (DataLoader
                workers split a rank's share, see ``reader_state.data_shard``).
        """
        index, count = shard if shard is not None else (self.rank, self.world_size)
        g, b = len(self.info.row_groups), self.unit_row_groups
        blocks = [range(lo, min(lo + b, g)) for lo in range(0, g, b)]
        n = len(blocks)
        order = np.random.default_rng([self.seed, epoch, 0]).permutation(n) if self.shuffle else np.arange(n)
        return [blocks[i] for i in order[index::count]]

    def __iter__(self) -> Iterator[TaskBatch]:
        for batch, _ in self.iter_with_state():
            yield batch

    def iter_with_state(self) -> Iterator[tuple[TaskBatch, dict[str, Any]]]:
        """Yields each TaskBatch with the reader state just after it (for checkpoints)."""
        if self._pos.done:
            self._pos = _Position(self._pos.epoch + 1, 0, 0, 0, False)
        start = self._pos
        end = _Position(start.epoch, 0, 0, 0, True)
        shard = data_shard(self.rank, self.world_size, mid_epoch=start.unit > 0 or start.offset > 0)
        units = self.units(start.epoch, shard)
        seed_words = (self.seed, 1, start.epoch) if self.train else (self.seed, 0)
        # A unit read before the unit its last task runs into gets that head from there.
        heads = HeadStash(wanted_heads(units[start.unit :]))
        args = (self.info, self.projection, self.policies, self._bounds, self.spec, seed_words, heads)
        loader = UnitLoader(
            lambda: UnitWorker(*args),
            units,
            [sum(self.info.row_groups[g].num_rows for g in unit) for unit in units],
            self.read_ahead,
            heads,
        )
        batches = self._batches(start, units, loader, shard[0])
        try:
            for (batch, pos, counters), last in with_last(batches):
                if last:  # the epoch is over: the state says done, every counter is final
                    pos, counters = end, dict(self.counters)
                self._pos, self._pos_counters = pos, counters
                yield batch, self.state_dict()
            self._pos, self._pos_counters = end, dict(self.counters)
        finally:
            batches.close()
            loader.close()

    def _batches(
        self, start: _Position, units: list[range], loader: UnitLoader, shard: int
    ) -> Iterator[tuple[TaskBatch, _Position, dict[str, int]]]:
        """Batches from ``start``, each with the position after it and the counters to
        pair with that position (see :func:`reader_state.counters_at`)."""
        epoch, t = start.epoch, self.cfg.tasks_per_batch
        carry: TaskPool | None = None
        for win in self._windows(epoch, start, units, loader, shard):
            pool, n = win.pool, win.pool.num_tasks
            i = start.offset if win.index == start.window else 0
            if i > n:
                raise DataError(
                    f"saved reader position (window {win.index}, task {i}) is past the window's {n} tasks; "
                    "did the dataset, the config or the read policies change?"
                )
            held = pool.held_rows + (carry.held_rows if carry is not None else 0) + loader.held_rows()
            self.counters["max_buffered_rows"] = max(self.counters["max_buffered_rows"], held)

            def emit(tasks: TaskPool, j: int, win: _Window = win, n: int = n):
                batch = self._build(tasks)
                self._count(batch)
                if j >= n:
                    return (
                        batch,
                        _Position(epoch, win.index + 1, win.unit_end, 0, False),
                        counters_at(self.counters),
                    )
                # A resume from inside the window loads its units again.
                pos = _Position(epoch, win.index, win.unit_start, j, False)
                return batch, pos, counters_at(self.counters, win.counts)

            if carry is not None:
                need = t - carry.num_tasks
                if n - i < need:
                    carry = TaskPool.concat([carry, pool.subset(np.arange(i, n))]).compact()
                    continue
                merged = TaskPool.concat([carry, pool.subset(np.arange(i, i + need))])
                carry = None
                i += need
                yield emit(merged, i)
            while n - i >= t:
                yield emit(pool.subset(np.arange(i, i + t)), i + t)
                i += t
            if i < n:  # compacted, so the carry does not keep the window's rows alive
                carry = pool.subset(np.arange(i, n)).compact()
        if carry is not None:
            if self.drop_last:
                self.counters["tasks_dropped_last"] += carry.num_tasks
            else:
                batch = self._build(carry)
                self._count(batch)
                yield batch, _Position(epoch, 0, 0, 0, True), counters_at(self.counters)

    def _windows(
        self, epoch: int, start: _Position, units: list[range], loader: UnitLoader, shard: int
    ) -> Iterator[_Window]:
        target = self.cfg.shuffle_buffer_tasks if self.shuffle else 1
        u, w = start.unit, start.window
        while u < len(units):
            first, pools, tasks, window_counts = u, [], 0, {}
            while u < len(units) and tasks < target:
                pool, counts = loader.get(u)
                add_counts(self.counters, counts)
                add_counts(window_counts, counts)
                u += 1
                if pool is not None:
                    pools.append(pool)
                    tasks += pool.num_tasks
            if not pools:
                return
            pool = TaskPool.concat(pools).merged()
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch, 1, shard, w]).permutation(pool.num_tasks)
                pool = pool.subset(perm)
            yield _Window(w, first, u, pool, window_counts)
            w += 1

    def _build(self, pool: TaskPool) -> TaskBatch:
        s, q = self.cfg.support_size, self.cfg.query_size
        if not self.train:  # evaluation keeps every row: widen to the largest task
            s = max(s, int(pool.num_support.max()))
            q = max(q, int(pool.num_query.max()))
        return build_task_batch(pool, s, q)

    def _count(self, batch: TaskBatch) -> None:
        self.counters["batches_yielded"] += 1
        self.counters["tasks_yielded"] += batch.num_tasks
        self.counters["rows_yielded"] += int(batch.support_mask.sum() + batch.query_mask.sum())

    def state_dict(self) -> dict[str, Any]:
        """The position after the last yielded batch, plus what it depends on (JSON-able)."""
        p = self._pos
        return {
            "version": _STATE_VERSION,
            "epoch": p.epoch,
            "window": p.window,
            "unit": p.unit,
            "task_offset": p.offset,
            "epoch_done": p.done,
            **self._fingerprint(),
            "counters": dict(self._pos_counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration resume at ``state`` (from :meth:`state_dict`).

        Raises:
            ConfigError: if the state is malformed or was taken with other settings.
            DataError: if it was taken on a dataset with other row groups.
        """
        keys = ("epoch", "window", "unit", "task_offset")
        fields, done = restore_position(state, _STATE_VERSION, self._fingerprint(), keys, "task reader")
        restore_counters(state, self.counters, "task reader")
        self._pos = _Position(*fields, done)
        self._pos_counters = dict(self.counters)

    def _fingerprint(self) -> dict[str, Any]:
        s = self.spec
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "train": self.train,
            "rank": self.rank,
            "world_size": self.world_size,
            "split": [
                s.policy,
                s.query_fraction,
                s.query_count,
                s.support_size,
                s.query_size,
                s.min_task_rows,
            ],
            "shuffle_buffer_tasks": self.cfg.shuffle_buffer_tasks,
            "unit_row_groups": self.unit_row_groups,
            **data_fingerprint(self.info, self.policies),
        }
