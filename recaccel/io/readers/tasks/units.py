"""Loading units (runs of row groups) into split tasks, optionally on worker threads.

A :class:`UnitWorker` is one thread's reading state: its own row-group reader, task
stream and counters, so workers share nothing mutable. :class:`UnitLoader` hands out
units in order; with ``ahead > 0`` it keeps the next ``ahead`` units loading on as many
threads while the caller batches the current one (Arrow decoding and most numpy work
release the GIL). A loaded unit is its kept tasks' rows only (split, sampled, copied
out of the decoded row groups with row-major ids), so a window is one cheap
concatenation and the row groups are freed early. Each load returns its counter
increments, which the caller adds to its own counters: task and split counts are the
same with or without threads; decode counts may grow, as each worker has its own cache
of decoded row groups and a task that crosses into the next unit's row group decodes
that row group once more, unless that unit was loaded first and kept the rows in the
shared :class:`HeadStash`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recaccel.io.format.dataset import DatasetInfo, row_group_reader
from recaccel.io.format.decode import Policies, Projection, add_counts, counter_increments, new_decode_stats
from recaccel.io.readers.processes import ProcessLoader
from recaccel.io.readers.read_ahead import WorkerLoader
from recaccel.io.readers.tasks.pool import TaskPool
from recaccel.io.readers.tasks.split import SPLIT_COUNTERS, SplitSpec, split_tasks
from recaccel.io.readers.tasks.stream import HeadStash, TaskStream


class UnitWorker:
    """Reads the tasks owned by units of row groups and splits them.

    Args:
        info: the dataset.
        projection: the columns to decode (task key and timestamp among the side columns).
        policies: bad-value policies.
        bounds: first / last task key of each row group (see ``stream.key_bounds``).
        spec: the split rules.
        seed_words: seed of the splits.
        heads: row-group heads shared by the workers of one pass, or None.
    """

    def __init__(
        self,
        info: DatasetInfo,
        projection: Projection,
        policies: Policies,
        bounds,
        spec: SplitSpec,
        seed_words: tuple[int, ...],
        heads: HeadStash | None = None,
    ) -> None:
        schema = info.schema
        self.stats = new_decode_stats()
        self.stats.update(dict.fromkeys(SPLIT_COUNTERS, 0), row_groups_read=0)
        self.source = row_group_reader(schema, projection, policies, self.stats, info.cache)
        self.stream = TaskStream(
            info, self.source, schema.task_key, schema.timestamp, bounds=bounds, stats=self.stats, heads=heads
        )
        self.spec = spec
        self.seed_words = seed_words

    def load(
        self, unit: range, note: Callable[[int], None] = lambda _: None
    ) -> tuple[TaskPool | None, dict[str, int]]:
        """The split (and, training, sampled) tasks the unit's row groups own, and the
        counter increments; ``note(g)`` before reading the tasks row group ``g`` owns."""
        before = dict(self.stats)
        pools = []
        for g in unit:
            note(g)
            for part in self.stream.owned(g):
                split = split_tasks(part.keys, part.times, self.spec, self.seed_words)
                add_counts(self.stats, split.counters)
                if split.keys.size:
                    sizes = (split.starts, split.num_support, split.num_query, split.keys)
                    pools.append(TaskPool.single(part.cols, split.rows, *sizes))
        delta = counter_increments(before, self.stats)
        # Only the kept rows, copied here on the worker thread: the caller's window
        # merge is then one contiguous copy and the decoded row groups are freed.
        return (TaskPool.concat(pools).compact(row_major_ids=True) if pools else None), delta

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True)
class UnitJob:
    """Loading units in a worker process (see :mod:`recaccel.io.readers.processes`):
    :class:`UnitWorker` arguments, without a shared head stash (processes share no
    memory), so a task crossing into a unit read elsewhere decodes that row group again."""

    info: DatasetInfo
    projection: Projection
    policies: Policies
    bounds: Any
    spec: SplitSpec
    seed_words: tuple[int, ...]
    units: list[range]

    def new_worker(self) -> UnitWorker:
        """A worker with its own row-group reader and counters."""
        return UnitWorker(self.info, self.projection, self.policies, self.bounds, self.spec, self.seed_words)

    def load(
        self, worker: UnitWorker, u: int, note: Callable[[int], None]
    ) -> tuple[TaskPool | None, dict[str, int]]:
        """Unit ``u``'s tasks and counter increments."""
        return worker.load(self.units[u], note)

    def where(self, u: int, g: int) -> str:
        """Row group ``g`` (or, -1, all of unit ``u``'s row groups), with their files."""
        refs = self.info.row_groups
        chosen = [g] if g >= 0 else list(self.units[u])
        return ", ".join(f"{refs[i].path} row group {refs[i].row_group}" for i in chosen)


class UnitLoader:
    """Loads units ``0 .. count-1`` on request, in order, ``ahead`` of them in advance.

    Args:
        new_worker: makes a :class:`UnitWorker` (one per thread, created lazily).
        units: the units, in read order.
        unit_rows: rows of each unit (footer counts), for memory accounting.
        ahead: units loaded in advance on that many threads; 0 = load on request.
        heads: the workers' shared row-group heads (counted in ``held_rows``), or None.
        processes: a job for worker processes, and how many (instead of threads).
        owner: who keeps the worker processes for its next iteration (the reader).
    """

    def __init__(
        self,
        new_worker: Callable[[], UnitWorker],
        units: list[range],
        unit_rows: list[int],
        ahead: int,
        heads: HeadStash | None = None,
        processes: tuple[UnitJob, int] | None = None,
        owner: object = None,
    ) -> None:
        self._unit_rows = unit_rows
        self._loads: WorkerLoader | ProcessLoader
        if processes is not None and units:  # no units: start no processes
            self._loads = ProcessLoader(processes[0], len(units), ahead, processes[1], owner=owner)
        else:
            self._loads = WorkerLoader(
                new_worker, lambda w, u: w.load(units[u]), len(units), ahead, name="recaccel-tasks"
            )
        self._heads = heads

    def get(self, u: int) -> tuple[TaskPool | None, dict[str, int]]:
        """Unit ``u``'s tasks and counter increments (raises what loading raised)."""
        return self._loads.get(u)

    def held_rows(self) -> int:
        """Rows of units being loaded ahead (footer counts), of the workers' caches and
        of the kept heads (those in worker processes not counted)."""
        ahead = sum(self._unit_rows[v] for v in self._loads.pending())
        heads = self._heads.rows if self._heads is not None else 0
        if isinstance(self._loads, ProcessLoader):
            return ahead + heads
        return ahead + heads + sum(w.stream.cached_rows for w in self._loads.workers.all())

    def close(self) -> None:
        """Cancels loads not started, waits for running ones, closes the workers' files."""
        self._loads.close()
