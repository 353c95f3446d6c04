"""Streaming, shuffling, sharded, resumable batch reader over Parquet row groups.

Epoch order. The dataset's non-empty row groups (file order) are permuted with an RNG
seeded by ``(seed, epoch)`` when shuffling, then sharded: rank r takes the row groups
at positions ``i`` of that list with ``i % world_size == r``. Sharding is by row group,
so ranks may get unequal numbers of rows (and of batches) in an epoch: a data-parallel
trainer must not assume equal batch counts per rank. This rank's row groups are grouped,
in order, into buffers of whole row groups holding at least ``shuffle_buffer_rows``
rows (footer counts); each buffer's rows are permuted with an RNG seeded by
``(seed, epoch, rank, buffer_index)`` and batches are cut from that order. Rows left at
the end of a buffer start the next batch, so batches cross buffer boundaries. Without
shuffle every buffer is one row group and rows come in file order. Inside a
``torch.utils.data.DataLoader`` with W > 1 workers, worker w of rank r reads shard
``r * W + w`` of ``world_size * W`` (the reader is an ``IterableDataset``), so every row
is still read once per epoch.

Memory is bounded by one buffer plus one batch of carried rows and the next batch
(cut one ahead, so the last batch of an epoch is known as such), about
``shuffle_buffer_rows + rows_per_row_group + 2 * batch_size`` rows, plus as much again for
each buffer decoded ahead on worker threads (``read_ahead``, default 2),
whatever the file sizes; ``counters["max_buffered_rows"]`` records the high-water mark.
Batches are gathered from the buffer straight into their own arrays.

Worker processes. With ``options.workers = N > 0``, buffer b is decoded by worker
process ``b % N``, which also cuts the batches lying wholly inside it once told how many
rows the buffers before it carry over (known from their decoded row counts); they come
back through shared memory (:mod:`recaccel.io.readers.processes`), and only batches
crossing buffers are put together here. Batches, order, states and counters are those of
``workers = 0``, except ``max_buffered_rows``, which counts ``max(read_ahead, workers)``
buffers loaded ahead. Each worker holds up to two buffers and its shared-memory slots.

Position. The reader is a cursor: iterating yields the batches from the current
position to the end of the epoch and moves the position along; ``state_dict()`` is
the position just after the last yielded batch, as (epoch, buffer index, row offset in
that buffer's shuffled order of the next batch's first row). Once the last batch of an
epoch has been yielded the position says ``epoch_done`` and the next iteration (here,
or in a reader given that state) runs epoch + 1. ``set_epoch(e)`` moves the position
to the start of epoch e. Only one iteration may be in progress at a time.

Counters. The state also carries the counters as they stand at its position, less the
decode counts of a partly consumed buffer (a resume decodes it again), so a reader
resumed from any state ends an epoch with the counters of an uninterrupted one;
``load_state_dict`` restores them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recaccel.config import DataConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.columns import Columns, take_batch
from recaccel.io.format.dataset import RowGroupReader, RowGroupRef, row_group_reader
from recaccel.io.format.decode import (
    Policies,
    Projection,
    add_counts,
    counter_increments,
    new_decode_stats,
)
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.readers.engine import Position, ShardedReader, buffer_permutation
from recaccel.io.readers.options import ReadOptions, Shard
from recaccel.io.readers.processes import Plan, ProcessLoader
from recaccel.io.readers.read_ahead import WorkerLoader
from recaccel.io.readers.state import counters_at
from recaccel.sparse import Batch

__all__ = ["BatchReader"]

_COUNTERS = ("rows_yielded", "batches_yielded", "rows_dropped_last", "max_buffered_rows")


class BatchReader(ShardedReader):
    """Iterable of CPU :class:`Batch` es read from Parquet (see the module docstring).

    Each batch has dense float32 [B, Dd], sparse ids with keys = the projected sparse
    fields in schema order (values int32 [N] when every table fits int32, else int64;
    offsets int64 [F*B+1], implicit when every field is one-hot) and labels
    float32 [B]; B = ``batch_size`` except maybe the last batch when not ``drop_last``.

    Example::

        rank 0 of 2, batch_size=4, shuffle_buffer_rows=6, row groups of 3 rows:

        row groups   g0[r0 r1 r2] g1[r3 r4 r5] g2[..] g3[..] g4[..] g5[..]
        epoch order  permute(seed, epoch) -> g4 g1 g0 g5 g3 g2; rank 0 takes g4 g0 g3
        buffers      [g4 g0] (6 rows >= 6) | [g3]
        rows         buffer 0 permuted by (seed, epoch, 1, 0, 0) -> r1 r13 r0 r12 r14 r2
        batches      [r1 r13 r0 r12] [r14 r2 + 2 rows of buffer 1] [last 1 row]
                     Batch(dense [4, Dd], sparse (values [N], offsets [F*4+1]), labels [4])
        state_dict() {"epoch": 0, "buffer_index": 1, "row_offset": 2, "epoch_done": False,
                      "seed": ..., "shuffle": ..., ..., "counters": {"rows_yielded": 8, ...}}

        reader = BatchReader("data/train", 512, ReadOptions(seed=1, shard=Shard(0, 2)))
        for batch, state in reader.iter_with_state():
            ...  # checkpoint `state`; BatchReader(...).load_state_dict(state) resumes there

    Args:
        path: a ``.parquet`` file or a directory of them.
        batch_size: rows per batch (B).
        options: shuffle, seed, drop_last, bad-value policies, read-ahead (shuffle
            buffers decoded in advance, each on its own worker thread, each adding a
            buffer to the memory held) and the rank's shard.
        shuffle_buffer_rows: rows per shuffle buffer (whole row groups, at least this many).
        schema: expected schema; None = the one stored in the files.
        columns: dense/sparse feature names to read; None = all.

    Attributes:
        info: the dataset footers (schema, files, row groups).
        schema: the dataset schema.
        counters: those of :mod:`recaccel.io.format.decode` plus ``rows_yielded``,
            ``batches_yielded``, ``rows_dropped_last`` and ``max_buffered_rows``;
            they count what this object did, batches cut one ahead included (the
            state carries those at its position, see the module docstring).

    Raises:
        ConfigError: on bad arguments.
        DataError: as :func:`open_dataset` does, and while iterating for unreadable row
            groups or bad values under an ``error`` policy.
    """

    _KEYS = ("buffer_index", "row_offset")
    _WHAT = "reader"

    def __init__(
        self,
        path: str | Path,
        batch_size: int,
        options: ReadOptions = ReadOptions(),  # noqa: B008 (frozen)
        *,
        shuffle_buffer_rows: int = 65_536,
        schema: FeatureSchema | None = None,
        columns: list[str] | tuple[str, ...] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if shuffle_buffer_rows < 1:
            raise ConfigError(f"shuffle_buffer_rows must be >= 1, got {shuffle_buffer_rows}")
        super().__init__(path, schema, options, _COUNTERS)
        self.projection = Projection.select(self.schema, columns)
        self.batch_size = batch_size
        self.shuffle_buffer_rows = shuffle_buffer_rows

    @classmethod
    def from_config(
        cls,
        path: str | Path,
        data_cfg: DataConfig,
        *,
        train: bool,
        rank: int = 0,
        world_size: int = 1,
        schema: FeatureSchema | None = None,
        columns: list[str] | tuple[str, ...] | None = None,
    ) -> BatchReader:
        """A reader configured by ``data_cfg``; for eval (not ``train``): no shuffle, no
        drop_last, ``eval_batch_size``. ``schema`` None = ``data_cfg.schema`` (a
        ``[data.schema]`` mapping), else the files' metadata."""
        return cls(
            path,
            data_cfg.batch_size if train else data_cfg.eval_batch_size,
            ReadOptions.from_config(data_cfg, train=train, shard=Shard(rank, world_size)),
            shuffle_buffer_rows=data_cfg.shuffle_buffer_rows,
            schema=schema if schema is not None else data_cfg.schema,  # None: the files' metadata
            columns=columns,
        )

    @property
    def num_batches(self) -> int:
        """Batches per epoch for a progress bar: exact for one rank when no row is skipped;
        with several ranks (whole row groups per rank) the mean over ranks."""
        rows = sum(ref.num_rows for ref in self.info.row_groups) // self.options.shard.world_size
        return self._batches_of(rows)

    def batches_in_epoch(self, epoch: int, shard: tuple[int, int] | None = None) -> int:
        """The batches ``epoch`` yields on this rank (or ``shard``), from the footers' row
        counts: exact when no row is skipped. Ranks hold whole row groups, so with several
        ranks and shuffling the count may change with ``epoch``."""
        own = self.options.shard
        refs = self.info.row_groups
        order = self.block_order(len(refs), epoch, shard or (own.rank, own.world_size))
        return self._batches_of(sum(refs[i].num_rows for i in order))

    def _batches_of(self, rows: int) -> int:
        """The batches ``rows`` rows make (the short last one dropped under ``drop_last``)."""
        return rows // self.batch_size if self.options.drop_last else -(-rows // self.batch_size)

    def buffers(self, epoch: int, shard: tuple[int, int] | None = None) -> list[list[RowGroupRef]]:
        """This rank's row groups in ``epoch``, grouped into shuffle buffers, in read order.

        Args:
            epoch: the epoch.
            shard: (shard, shards) to read instead of (rank, world_size) (DataLoader
                workers split a rank's share, see ``Shard.for_worker``).
        """
        own = self.options.shard
        refs = self.info.row_groups
        target = self.shuffle_buffer_rows if self.options.shuffle else 1
        out: list[list[RowGroupRef]] = []
        cur: list[RowGroupRef] = []
        rows = 0
        for i in self.block_order(len(refs), epoch, shard or (own.rank, own.world_size)):
            cur.append(refs[i])
            rows += refs[i].num_rows
            if rows >= target:
                out.append(cur)
                cur, rows = [], 0
        if cur:
            out.append(cur)
        return out

    def _check_position(self, position: Position) -> None:
        """A saved ``(buffer_index, row_offset)`` must lie in this rank's buffers of its epoch,
        the row within its buffer's rows as the row groups' metadata counts them (a read
        policy can only drop rows: past those it is past the decoded buffer too). Caught
        when iterating only, a buffer index past the last skipped the epoch's rest silently."""
        if position.done:
            return
        buffer, row = position.fields
        buffers = self.buffers(position.epoch)
        rows = sum(ref.num_rows for ref in buffers[buffer]) if buffer < len(buffers) else 0
        if buffer > len(buffers) or row > rows:
            raise DataError(
                f"saved reader position (epoch {position.epoch}, buffer {buffer}, row {row}) is past this "
                f"rank's data: {len(buffers)} shuffle buffer{'s' if len(buffers) != 1 else ''}"
                + (f", buffer {buffer} of {rows} rows" if buffer < len(buffers) else "")
                + "; did the dataset change?"
            )

    def _settings(self) -> dict[str, object]:
        o = self.options
        return {
            "seed": o.seed,
            "shuffle": o.shuffle,
            "shuffle_buffer_rows": self.shuffle_buffer_rows,
            "rank": o.shard.rank,
            "world_size": o.shard.world_size,
        }

    def _cut(
        self, start: Position, shard: tuple[int, int]
    ) -> Iterator[tuple[Batch, Position, dict[str, int]]]:
        if self.options.workers:
            yield from self._cut_in_workers(start, shard)
            return
        epoch, (start_buffer, start_offset) = start.epoch, start.fields
        buffers = self.buffers(epoch, shard)
        bs = self.batch_size
        carry: Columns | None = None
        carry_rows = 0
        # Each iteration owns its loader (file handles, threads): an abandoned iterator
        # closing them must not disturb a newer one.
        loader = self._loader(buffers)
        try:
            for b in range(start_buffer, len(buffers)):
                cols, delta = loader.get(b)
                add_counts(self.counters, delta)
                n = cols.num_rows
                i = start_offset if b == start_buffer else 0
                if i > n:
                    raise DataError(
                        f"saved reader position (buffer {b}, row {i}) is past the buffer's {n} rows; "
                        "did the dataset or the read policies change?"
                    )
                order = self.buffer_order(epoch, shard[0], b, n)
                ahead = sum(r.num_rows for a in loader.pending() for r in buffers[a])
                self.note_held(n + carry_rows + ahead)
                while n - i >= bs - carry_rows:
                    j = i + bs - carry_rows
                    if carry is None:  # gathered once, straight into the batch's arrays
                        batch = take_batch(cols, slice(i, j) if order is None else order[i:j])
                    else:
                        batch = Columns.concat([carry, _rows_of(cols, order, i, j)]).to_batch()
                    i = j
                    carry, carry_rows = None, 0
                    self._count(batch)
                    if i < n:  # a resume from here decodes buffer b again
                        yield batch, Position(epoch, (b, i)), counters_at(self.counters, delta)
                    else:
                        yield batch, Position(epoch, (b + 1, 0)), counters_at(self.counters)
                if i < n:  # a copy, so the carry does not pin the whole buffer
                    rest = cols.take(np.arange(i, n) if order is None else order[i:n])
                    carry = rest if carry is None else Columns.concat([carry, rest])
                    carry_rows += n - i
                del cols
            yield from self._last_batch(carry, carry_rows, Position(epoch, (len(buffers), 0), True))
        finally:
            loader.close()

    def _loader(self, buffers: list[list[RowGroupRef]]) -> WorkerLoader:
        """Decodes the shuffle buffers of one iteration, ``read_ahead`` in advance.

        Each worker thread has its own file handles and counters; Arrow decoding and
        numpy's large-array work release the GIL. Buffers come back in order with their
        counter increments, and a decode error is raised when its buffer is asked for,
        so results, counters and errors are those of an inline read (a first-occurrence
        warning may be logged once per thread).
        """
        job = self._job(buffers, 0, 0)
        return WorkerLoader(job.new_worker, job.load, len(buffers), self.options.read_ahead)

    def _job(self, buffers: list[list[RowGroupRef]], epoch: int, shard: int) -> _BufferJob:
        o = self.options
        return _BufferJob(
            self.schema,
            self.projection,
            self.policies,
            o.shuffle,
            buffers,
            o.seed,
            epoch,
            shard,
            self.batch_size,
            self.info.cache,
        )

    def _cut_in_workers(
        self, start: Position, shard: tuple[int, int]
    ) -> Iterator[tuple[Batch, Position, dict[str, int]]]:
        """``_cut`` with ``options.workers`` processes: worker ``b % workers`` decodes buffer
        b and cuts the batches that lie inside it (told the rows carried into it, see
        ``_BufferJob.finish``); here, batches crossing buffers are put together from the
        carried rows and the next buffer's head, with the same operations ``_cut`` runs."""
        epoch, (start_buffer, start_offset) = start.epoch, start.fields
        buffers = self.buffers(epoch, shard)
        bs = self.batch_size
        carry: Columns | None = None
        carry_rows = 0
        if start_buffer >= len(buffers):  # nothing to read: start no processes
            return
        plan = Plan(start_buffer, (0, start_offset), functools.partial(_carried_rows, bs))
        loader = ProcessLoader(
            self._job(buffers, epoch, shard[0]),
            len(buffers),
            self.options.read_ahead,
            self.options.workers,
            plan,
            owner=self,  # the processes outlive this iteration: the next epoch reuses them
        )
        try:
            for b in range(start_buffer, len(buffers)):
                piece = loader.get(b)
                add_counts(self.counters, piece.delta)
                n, i = piece.num_rows, start_offset if b == start_buffer else 0
                ahead = sum(r.num_rows for a in loader.pending() for r in buffers[a])
                self.note_held(n + carry_rows + ahead)
                batches = piece.batches
                if piece.head is not None:
                    batches = [Columns.concat([carry, piece.head]).to_batch(), *batches]
                    carry = None
                for batch in batches:
                    i += bs - carry_rows
                    carry_rows = 0
                    self._count(batch)
                    if i < n:  # a resume from here decodes buffer b again
                        yield batch, Position(epoch, (b, i)), counters_at(self.counters, piece.delta)
                    else:
                        yield batch, Position(epoch, (b + 1, 0)), counters_at(self.counters)
                if piece.tail is not None:
                    carry = piece.tail if carry is None else Columns.concat([carry, piece.tail])
                    carry_rows += n - i
            yield from self._last_batch(carry, carry_rows, Position(epoch, (len(buffers), 0), True))
        finally:
            loader.close()

    def _last_batch(
        self, carry: Columns | None, carry_rows: int, end: Position
    ) -> Iterator[tuple[Batch, Position, dict[str, int]]]:
        """The rows carried past the last buffer: one short batch, or counted as dropped."""
        if carry_rows and not self.options.drop_last:
            batch = carry.to_batch()
            self._count(batch)
            yield batch, end, counters_at(self.counters)
        self.counters["rows_dropped_last"] += carry_rows if self.options.drop_last else 0

    def _count(self, batch: Batch) -> None:
        self.counters["rows_yielded"] += batch.batch_size
        self.counters["batches_yielded"] += 1


@dataclass(frozen=True)
class _BufferJob:
    """Decoding shuffle buffers: what a reader thread or worker process runs (picklable)."""

    schema: FeatureSchema
    projection: Projection
    policies: Policies
    shuffle: bool
    buffers: list[list[RowGroupRef]]
    seed: int
    epoch: int
    shard: int
    batch_size: int
    cache: Path | None = None  # the dataset's pre-decoded cache folder (DatasetInfo.cache)

    def new_worker(self) -> RowGroupReader:
        """A row-group reader (Parquet, or the dataset's cache) with its own files and counters."""
        return row_group_reader(self.schema, self.projection, self.policies, new_decode_stats(), self.cache)

    def load(
        self, source: RowGroupReader, b: int, note: Callable[[int], None] = lambda _: None
    ) -> tuple[Columns, dict[str, int]]:
        """Buffer ``b``'s rows and the counter increments; ``note(k)`` before its k-th row group."""
        before = dict(source.stats)
        parts = []
        for k, ref in enumerate(self.buffers[b]):
            note(k)
            parts.append(source.read(ref))
        # Shuffled rows are gathered at random: row-major ids make that cache-friendly.
        cols = Columns.concat(parts, row_major_ids=self.shuffle)
        return cols, counter_increments(before, source.stats)

    def size(self, loaded: tuple[Columns, dict[str, int]]) -> int:
        """A decoded buffer's rows (what the rows carried into the next one depend on)."""
        return loaded[0].num_rows

    def finish(self, loaded: tuple[Columns, dict[str, int]], b: int, arg: tuple[int, int]) -> _Pieces:
        """Cuts decoded buffer ``b``, which ``arg = (carried, start)`` rows carried into
        from the buffers before it and whose rows before ``start`` were read before a
        resume: the rows completing the carried batch, the whole batches, the rest."""
        cols, delta = loaded
        carried, i = arg
        n, bs = cols.num_rows, self.batch_size
        if i > n:
            raise DataError(
                f"saved reader position (buffer {b}, row {i}) is past the buffer's {n} rows; "
                "did the dataset or the read policies change?"
            )
        order = buffer_permutation(self.seed, self.epoch, self.shard, b, n) if self.shuffle else None
        head = None
        if carried and n - i >= bs - carried:
            head, i, carried = _rows_of(cols, order, i, i + bs - carried), i + bs - carried, 0
        batches = []
        while not carried and n - i >= bs:  # gathered straight into the batch's arrays
            batches.append(take_batch(cols, slice(i, i + bs) if order is None else order[i : i + bs]))
            i += bs
        tail = cols.take(np.arange(i, n) if order is None else order[i:n]) if i < n else None
        return _Pieces(n, delta, head, batches, tail)

    def where(self, b: int, k: int) -> str:
        """The row group(s) of buffer ``b`` (its k-th; -1 = any)."""
        refs = self.buffers[b]
        chosen = [refs[k]] if 0 <= k < len(refs) else refs
        return ", ".join(f"{ref.path} row group {ref.row_group}" for ref in chosen)


@dataclass
class _Pieces:
    """A buffer cut in a worker process (see ``_BufferJob.finish``)."""

    num_rows: int
    delta: dict[str, int]
    head: Columns | None
    batches: list[Batch]
    tail: Columns | None


def _carried_rows(batch_size: int, arg: tuple[int, int], num_rows: int) -> tuple[int, int]:
    """The (carried, start) argument of the buffer after one with ``arg`` and ``num_rows``:
    the rows left over once batches are cut, as ``_cut`` leaves them."""
    carried, start = arg
    rows = carried + num_rows - start
    return (rows if rows < batch_size else rows % batch_size), 0


def _rows_of(cols: Columns, order: np.ndarray | None, start: int, stop: int) -> Columns:
    """Rows ``start .. stop-1`` of the buffer's read order."""
    return cols.slice(start, stop) if order is None else cols.take(order[start:stop])
