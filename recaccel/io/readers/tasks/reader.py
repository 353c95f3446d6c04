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

Batches per epoch. ``num_batches`` is exact for the rank: opening the reader reads the
task key column of every row group once (to find where tasks start; from a pre-decoded
cache, the keys its build recorded of that column), and with it
counts the tasks of at least ``min_task_rows`` rows each row group owns
(:mod:`recaccel.io.readers.tasks.count`); no other column is decoded.

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

Worker processes. With ``options.workers = N > 0`` unit u is loaded (decoded, split,
sampled, compacted) by worker process ``u % N`` and comes back through shared memory
(:mod:`recaccel.io.readers.processes`); windows and batches are made here as without
workers, so batches, order and positions do not depend on N. Processes share no head
stash, so the decode counters (``rows_read``, ``row_groups_read``) may count more row
groups decoded twice, as they may with read-ahead threads.

Position. As in :class:`~recaccel.io.readers.rows.BatchReader`: ``state_dict()`` is the
position after the last yielded batch: (epoch, window index, the window's first unit,
tasks of the window already consumed). Resuming rebuilds that window from its first
unit and yields exactly the remaining batches. The state carries the counters at its
position, less the counts of the window a resume loads again, and ``load_state_dict``
restores them. Decode counters (``rows_read``, ...)
count decodes: a row group decoded again to complete a task counts twice (this
happens when a unit is read before the unit its last task runs into; read after it,
the task's rows there were kept by that unit, see ``stream.HeadStash``); the task
and row counters count each task and row once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from recaccel.config import Config, DataConfig, TasksConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.decode import Projection, add_counts
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.readers.engine import Position, ShardedReader
from recaccel.io.readers.options import ReadOptions, Shard
from recaccel.io.readers.state import counters_at
from recaccel.io.readers.tasks.count import batch_count, kept_tasks_owned
from recaccel.io.readers.tasks.pool import TaskPool, build_task_batch
from recaccel.io.readers.tasks.split import SPLIT_COUNTERS, SplitSpec
from recaccel.io.readers.tasks.stream import HeadStash, check_order, key_index, wanted_heads
from recaccel.io.readers.tasks.units import UnitJob, UnitLoader, UnitWorker
from recaccel.sparse import TaskBatch

__all__ = ["TaskReader"]

_COUNTERS = (
    *SPLIT_COUNTERS,
    "tasks_yielded",
    "rows_yielded",
    "batches_yielded",
    "tasks_dropped_last",
    "row_groups_read",
    "max_buffered_rows",
)


@dataclass
class _Window:
    index: int
    unit_start: int
    unit_end: int
    pool: TaskPool
    counts: dict[str, int]  # counter increments of loading its units


class TaskReader(ShardedReader):
    """Iterable of CPU :class:`TaskBatch` es read from task-grouped Parquet (module doc).

    Example::

        T=2 tasks per batch, S=2 support, Q=1 query, unit_row_groups=1, one rank:

        rows (sorted by key)  g0[a a a b b] g1[b c c c] g2[d d d e e e]
        units                 u0=g0 owns a, b (b completed from g1); u1=g1 owns c; u2=g2 owns d, e
        epoch order           permute(seed, epoch) -> u2 u0 u1; windows of >= shuffle_buffer_tasks
        tasks                 split per task: support | query, sampled to S, padded to S
        batches               TaskBatch(task_ids [2], support Batch [T*S=4 rows], support_mask [2, 2],
                                        query Batch [T*Q=2 rows], query_mask [2, 1])
        state_dict()          {"epoch": 0, "window": 1, "unit": 1, "task_offset": 1,
                               "epoch_done": False, "seed": ..., ..., "counters": {"tasks_yielded": 4, ...}}

        reader = TaskReader("data/tasks", TasksConfig(tasks_per_batch=32), ReadOptions(seed=1))
        for tb in reader:
            ...  # tb.support, tb.query: Batch; tb.support_mask, tb.query_mask: [T, S], [T, Q]

    Args:
        path: a ``.parquet`` file or a directory of them, sorted by task key.
        cfg: T, S, Q, minimum task rows, split policy, query fraction, buffer size and
            ``unit_row_groups`` (row groups per unit of shuffling and sharding; a unit's
            last task usually runs into the next row group, which is then decoded once
            more; longer units make that rarer).
        options: seed (of shuffles, splits and sampling), shuffle and drop_last (training
            only), bad-value policies, read-ahead (units decoded, split and compacted in
            advance, each on its own thread, see :mod:`recaccel.io.readers.tasks.units`)
            and the rank's shard.
        train: False = evaluation mode (every row kept; see the module docstring).
        query_count: > 0: exactly this many query rows per task (the rest support),
            instead of ``cfg.query_fraction``. None = ``cfg.query_count`` if > 0, else
            ``cfg.query_size`` when ``cfg.query_fraction <= 0``, else 0.
        schema: expected schema; None = the one stored in the files.
        columns: dense/sparse feature names to read; None = all.

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

    _KEYS = ("window", "unit", "task_offset")
    _WHAT = "task reader"

    def __init__(
        self,
        path: str | Path,
        cfg: TasksConfig,
        options: ReadOptions = ReadOptions(),  # noqa: B008 (frozen)
        *,
        train: bool = True,
        query_count: int | None = None,
        schema: FeatureSchema | None = None,
        columns: list[str] | tuple[str, ...] | None = None,
    ) -> None:
        if cfg.tasks_per_batch < 1:
            raise ConfigError(f"tasks.tasks_per_batch must be >= 1, got {cfg.tasks_per_batch}")
        if cfg.shuffle_buffer_tasks < 1:
            raise ConfigError(f"tasks.shuffle_buffer_tasks must be >= 1, got {cfg.shuffle_buffer_tasks}")
        if cfg.unit_row_groups < 1:
            raise ConfigError(f"unit_row_groups must be >= 1, got {cfg.unit_row_groups}")
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
        options = replace(options, shuffle=options.shuffle and train, drop_last=options.drop_last and train)
        super().__init__(path, schema, options, _COUNTERS)
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
        self.train = train
        index = key_index(self.info, self.schema.task_key, self.spec.min_task_rows)
        self._bounds = (index.first, index.last)
        check_order(self.info, *self._bounds, self.schema.task_key)
        self._kept_owned = kept_tasks_owned(index)  # kept tasks each row group owns

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
        shard = Shard(rank, world_size)
        options = ReadOptions.from_config(data_cfg, train=train, shard=shard, read_ahead=tasks_cfg.read_ahead)
        schema = schema if schema is not None else data_cfg.schema  # a [data.schema] mapping, or None
        return cls(
            path, tasks_cfg, options, train=train, query_count=query_count, schema=schema, columns=columns
        )

    @property
    def num_batches(self) -> int:
        """Batches of the epoch the next iteration reads, exact for this rank (counted
        from the task key's row-group index, see :meth:`batches_in_epoch`)."""
        return self.batches_in_epoch(self.epoch)

    def batches_in_epoch(self, epoch: int, shard: tuple[int, int] | None = None) -> int:
        """The batches an epoch yields, counted without decoding the data: the kept tasks
        (at least ``min_task_rows`` rows) that the shard's units own, T per batch.

        With several ranks and shuffling, ranks get other units each epoch, so the count
        may change with ``epoch``; with one rank it does not.

        Args:
            epoch: the epoch.
            shard: (shard, shards) instead of (rank, world_size), e.g. one DataLoader
                worker's share of the rank (each worker cuts its own short last batch).
        """
        tasks = sum(int(self._kept_owned[unit.start : unit.stop].sum()) for unit in self.units(epoch, shard))
        return batch_count(tasks, self.cfg.tasks_per_batch, self.options.drop_last)

    def units(self, epoch: int, shard: tuple[int, int] | None = None) -> list[range]:
        """This rank's units (runs of ``unit_row_groups`` consecutive row groups, as
        indices into ``info.row_groups``) in read order.

        Args:
            epoch: the epoch.
            shard: (shard, shards) to read instead of (rank, world_size) (DataLoader
                workers split a rank's share, see ``Shard.for_worker``).
        """
        own = self.options.shard
        g, b = len(self.info.row_groups), self.cfg.unit_row_groups
        blocks = [range(lo, min(lo + b, g)) for lo in range(0, g, b)]
        return [blocks[i] for i in self.block_order(len(blocks), epoch, shard or (own.rank, own.world_size))]

    def _settings(self) -> dict[str, object]:
        o, s = self.options, self.spec
        return {
            "seed": o.seed,
            "shuffle": o.shuffle,
            "train": self.train,
            "rank": o.shard.rank,
            "world_size": o.shard.world_size,
            "split": [
                s.policy,
                s.query_fraction,
                s.query_count,
                s.support_size,
                s.query_size,
                s.min_task_rows,
            ],
            "shuffle_buffer_tasks": self.cfg.shuffle_buffer_tasks,
            "unit_row_groups": self.cfg.unit_row_groups,
        }

    def _end(self, pos: Position) -> Position:
        return Position(pos.epoch, (0, 0, 0), True)

    def _cut(
        self, start: Position, shard: tuple[int, int]
    ) -> Iterator[tuple[TaskBatch, Position, dict[str, int]]]:
        units = self.units(start.epoch, shard)
        seed = self.options.seed
        seed_words = (seed, 1, start.epoch) if self.train else (seed, 0)
        # A unit read before the unit its last task runs into gets that head from there.
        heads = HeadStash(wanted_heads(units[start.fields[1] :]))
        args = (self.info, self.projection, self.policies, self._bounds, self.spec, seed_words)
        workers = self.options.workers
        loader = UnitLoader(
            lambda: UnitWorker(*args, heads),
            units,
            [sum(self.info.row_groups[g].num_rows for g in unit) for unit in units],
            self.options.read_ahead,
            None if workers else heads,
            (UnitJob(*args, units), workers) if workers else None,
            owner=self,  # worker processes outlive this iteration: the next epoch reuses them
        )
        try:
            yield from self._batches(start, units, loader, shard[0])
        finally:
            loader.close()

    def _batches(
        self, start: Position, units: list[range], loader: UnitLoader, shard: int
    ) -> Iterator[tuple[TaskBatch, Position, dict[str, int]]]:
        epoch, t = start.epoch, self.cfg.tasks_per_batch
        start_window, _, start_offset = start.fields
        carry: TaskPool | None = None
        for win in self._windows(epoch, start, units, loader, shard):
            pool, n = win.pool, win.pool.num_tasks
            i = start_offset if win.index == start_window else 0
            if i > n:
                raise DataError(
                    f"saved reader position (window {win.index}, task {i}) is past the window's {n} tasks; "
                    "did the dataset, the config or the read policies change?"
                )
            self.note_held(
                pool.held_rows + (carry.held_rows if carry is not None else 0) + loader.held_rows()
            )

            def emit(tasks: TaskPool, j: int, win: _Window = win, n: int = n):
                batch = self._build(tasks)
                self._count(batch)
                if j >= n:
                    return (
                        batch,
                        Position(epoch, (win.index + 1, win.unit_end, 0)),
                        counters_at(self.counters),
                    )
                # A resume from inside the window loads its units again.
                pos = Position(epoch, (win.index, win.unit_start, j))
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
            if self.options.drop_last:
                self.counters["tasks_dropped_last"] += carry.num_tasks
            else:
                batch = self._build(carry)
                self._count(batch)
                yield batch, self._end(start), counters_at(self.counters)

    def _windows(
        self, epoch: int, start: Position, units: list[range], loader: UnitLoader, shard: int
    ) -> Iterator[_Window]:
        target = self.cfg.shuffle_buffer_tasks if self.options.shuffle else 1
        w, u = start.fields[0], start.fields[1]
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
            perm = self.buffer_order(epoch, shard, w, pool.num_tasks)
            if perm is not None:
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
