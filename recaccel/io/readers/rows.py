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

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from recaccel.config import DataConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.columns import Columns, take_batch
from recaccel.io.format.dataset import DatasetInfo, RowGroupReader, RowGroupRef, open_dataset
from recaccel.io.format.decode import (
    Policies,
    Projection,
    add_counts,
    counter_increments,
    new_decode_stats,
    row_group_to_columns,
)
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.format.writer import DatasetWriter, write_parquet
from recaccel.io.readers.read_ahead import PerThread, ReadAhead
from recaccel.io.readers.state import (
    check_reader_args,
    counters_at,
    data_fingerprint,
    data_shard,
    restore_counters,
    restore_position,
    with_last,
)
from recaccel.sparse import Batch

__all__ = [
    "BatchReader",
    "Columns",
    "DatasetInfo",
    "DatasetWriter",
    "Policies",
    "Projection",
    "RowGroupRef",
    "open_dataset",
    "row_group_to_columns",
    "write_parquet",
]

_STATE_VERSION = 1


@dataclass(frozen=True)
class _Position:
    epoch: int
    buffer: int
    offset: int
    done: bool


class BatchReader(IterableDataset):
    """Iterable of CPU :class:`Batch` es read from Parquet (see the module docstring).

    Each batch has dense float32 [B, Dd], sparse ids with keys = the projected sparse
    fields in schema order (values int64 [N], offsets int64 [F*B+1]) and labels
    float32 [B]; B = ``batch_size`` except maybe the last batch when not ``drop_last``.

    Args:
        path: a ``.parquet`` file or a directory of them.
        batch_size: rows per batch (B).
        schema: expected schema; None = the one stored in the files.
        columns: dense/sparse feature names to read; None = all.
        shuffle: shuffle row groups and rows within buffers.
        seed: base seed of every shuffle (>= 0).
        shuffle_buffer_rows: rows per shuffle buffer (whole row groups, at least this many).
        rank: this process's shard, 0 <= rank < world_size.
        world_size: number of shards.
        drop_last: drop the epoch's last batch if it is short.
        invalid_ids: ``error`` | ``skip`` | ``clip`` | ``hash``.
        invalid_dense: ``error`` | ``skip`` | ``zero``.
        invalid_labels: ``error`` | ``skip``.
        read_ahead: shuffle buffers decoded in advance, each on its own worker thread,
            while batches are cut from the current one (0 = decode inline). Each one
            adds a buffer to the memory held; batches, order and state do not depend on it.

    Attributes:
        info: the dataset footers (schema, files, row groups).
        schema: the dataset schema.
        counters: counters: those of :mod:`recaccel.io.format.decode` plus ``rows_yielded``,
            ``batches_yielded``, ``rows_dropped_last`` and ``max_buffered_rows``;
            they count what this object did, batches cut one ahead included (the
            state carries those at its position, see the module docstring).

    Raises:
        ConfigError: on bad arguments.
        DataError: as :func:`open_dataset` does, and while iterating for unreadable row
            groups or bad values under an ``error`` policy.
    """

    def __init__(
        self,
        path: str | Path,
        batch_size: int,
        *,
        schema: FeatureSchema | None = None,
        columns: list[str] | tuple[str, ...] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer_rows: int = 65_536,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        invalid_ids: str = "error",
        invalid_dense: str = "error",
        invalid_labels: str = "error",
        read_ahead: int = 2,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        check_reader_args(seed=seed, rank=rank, world_size=world_size, read_ahead=read_ahead)
        if shuffle_buffer_rows < 1:
            raise ConfigError(f"shuffle_buffer_rows must be >= 1, got {shuffle_buffer_rows}")
        self.policies = Policies(invalid_ids, invalid_dense, invalid_labels)
        self.info: DatasetInfo = open_dataset(path, schema)
        self.schema = self.info.schema
        self.projection = Projection.select(self.schema, columns)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer_rows = shuffle_buffer_rows
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.read_ahead = read_ahead
        self.counters: dict[str, int] = new_decode_stats()
        self.counters.update(rows_yielded=0, batches_yielded=0, rows_dropped_last=0, max_buffered_rows=0)
        self._pos = _Position(0, 0, 0, False)
        self._pos_counters = dict(self.counters)  # paired with _pos

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
        drop_last, ``eval_batch_size``."""
        return cls(
            path,
            data_cfg.batch_size if train else data_cfg.eval_batch_size,
            schema=schema,
            columns=columns,
            shuffle=data_cfg.shuffle if train else False,
            seed=data_cfg.seed,
            shuffle_buffer_rows=data_cfg.shuffle_buffer_rows,
            rank=rank,
            world_size=world_size,
            drop_last=data_cfg.drop_last if train else False,
            invalid_ids=data_cfg.invalid_ids,
            invalid_dense=data_cfg.invalid_dense,
            invalid_labels=data_cfg.invalid_labels,
            read_ahead=data_cfg.read_ahead,
        )

    @property
    def stats(self) -> dict[str, int]:
        """Deprecated alias of :attr:`counters` (read-only)."""
        return self.counters

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._pos.epoch + 1 if self._pos.done else self._pos.epoch

    @property
    def num_batches(self) -> int:
        """Batches per epoch for a progress bar: exact for one rank when no row is skipped;
        with several ranks (whole row groups per rank) the mean over ranks."""
        rows = sum(ref.num_rows for ref in self.info.row_groups) // self.world_size
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Moves the position to the start of ``epoch`` (counters go on counting)."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        self._pos = _Position(epoch, 0, 0, False)
        self._pos_counters = dict(self.counters)

    def __iter__(self) -> Iterator[Batch]:
        for batch, _ in self.iter_with_state():
            yield batch

    def iter_with_state(self) -> Iterator[tuple[Batch, dict[str, Any]]]:
        """Like iterating, but yields each batch with the state just after it.

        A prefetching loader runs ahead of the consumer; it should checkpoint the state
        paired with the last batch the trainer consumed, not ``state_dict()``.
        """
        if self._pos.done:
            self._pos = _Position(self._pos.epoch + 1, 0, 0, False)
        cuts = self._cut(self._pos)
        try:
            for (batch, pos, counters), last in with_last(cuts):
                if last:  # the epoch is over: the state says done, every counter is final
                    pos, counters = replace(pos, done=True), dict(self.counters)
                self._pos, self._pos_counters = pos, counters
                yield batch, self.state_dict()
            self._pos, self._pos_counters = replace(self._pos, done=True), dict(self.counters)
        finally:
            cuts.close()

    def _cut(self, start: _Position) -> Iterator[tuple[Batch, _Position, dict[str, int]]]:
        """Batches from ``start`` to the epoch's end, each with the position after it and
        the counters to pair with that position (see :func:`reader_state.counters_at`)."""
        epoch = start.epoch
        shard = data_shard(self.rank, self.world_size, mid_epoch=start.buffer > 0 or start.offset > 0)
        buffers = self.buffers(epoch, shard)
        bs = self.batch_size
        carry: Columns | None = None
        carry_rows = 0
        # Each iteration owns its loader (file handles, thread): an abandoned iterator
        # closing them must not disturb a newer one.
        loader = _BufferLoader(self, buffers)
        try:
            for b in range(start.buffer, len(buffers)):
                cols, delta = loader.get(b)
                add_counts(self.counters, delta)
                n = cols.num_rows
                i = start.offset if b == start.buffer else 0
                if i > n:
                    raise DataError(
                        f"saved reader position (buffer {b}, row {i}) is past the buffer's {n} rows; "
                        "did the dataset or the read policies change?"
                    )
                order = self._buffer_order(epoch, shard[0], b, n)
                held = n + carry_rows + loader.ahead_rows()
                self.counters["max_buffered_rows"] = max(self.counters["max_buffered_rows"], held)
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
                        yield batch, _Position(epoch, b, i, False), counters_at(self.counters, delta)
                    else:
                        yield batch, _Position(epoch, b + 1, 0, False), counters_at(self.counters)
                if i < n:  # a copy, so the carry does not pin the whole buffer
                    rest = cols.take(np.arange(i, n) if order is None else order[i:n])
                    carry = rest if carry is None else Columns.concat([carry, rest])
                    carry_rows += n - i
                del cols
            if carry_rows and not self.drop_last:
                batch = carry.to_batch()
                self._count(batch)
                yield batch, _Position(epoch, len(buffers), 0, True), counters_at(self.counters)
            self.counters["rows_dropped_last"] += carry_rows if self.drop_last else 0
        finally:
            loader.close()

    def buffers(self, epoch: int, shard: tuple[int, int] | None = None) -> list[list[RowGroupRef]]:
        """This rank's row groups in ``epoch``, grouped into shuffle buffers, in read order.

        Args:
            epoch: the epoch.
            shard: (shard, shards) to read instead of (rank, world_size) (DataLoader
                workers split a rank's share, see ``reader_state.data_shard``).
        """
        index, count = shard if shard is not None else (self.rank, self.world_size)
        refs = self.info.row_groups
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(refs))
        else:
            order = np.arange(len(refs))
        target = self.shuffle_buffer_rows if self.shuffle else 1
        out: list[list[RowGroupRef]] = []
        cur: list[RowGroupRef] = []
        rows = 0
        for i in order[index::count]:
            cur.append(refs[i])
            rows += refs[i].num_rows
            if rows >= target:
                out.append(cur)
                cur, rows = [], 0
        if cur:
            out.append(cur)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position after the last yielded batch, plus what it depends on and the
        counters at that position (JSON-able)."""
        p = self._pos
        return {
            "version": _STATE_VERSION,
            "epoch": p.epoch,
            "buffer_index": p.buffer,
            "row_offset": p.offset,
            "epoch_done": p.done,
            **self._fingerprint(),
            "counters": dict(self._pos_counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration resume at ``state`` (from :meth:`state_dict`).

        Raises:
            ConfigError: if the state is malformed or was taken with a different seed,
                shuffle, buffer size, rank, world size or read policies.
            DataError: if it was taken on a dataset with other row groups.
        """
        keys = ("epoch", "buffer_index", "row_offset")
        fields, done = restore_position(state, _STATE_VERSION, self._fingerprint(), keys, "reader")
        restore_counters(state, self.counters, "reader")
        self._pos = _Position(*fields, done)
        self._pos_counters = dict(self.counters)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer_rows": self.shuffle_buffer_rows,
            "rank": self.rank,
            "world_size": self.world_size,
            **data_fingerprint(self.info, self.policies),
        }

    def _buffer_order(self, epoch: int, shard: int, buffer: int, n: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, epoch, 1, shard, buffer]).permutation(n)

    def _count(self, batch: Batch) -> None:
        self.counters["rows_yielded"] += batch.batch_size
        self.counters["batches_yielded"] += 1


class _BufferLoader:
    """Decodes the shuffle buffers of one iteration, ``read_ahead`` buffers in advance.

    With ``read_ahead > 0`` that many worker threads decode the next buffers (each with
    its own file handles and counters) while the caller cuts batches from the current
    one; Arrow decoding and numpy's large-array work release the GIL. Buffers come back
    in order with their counter increments, and a decode error is raised when its buffer
    is asked for, so results, counters and errors are those of an inline read (a
    first-occurrence warning may be logged once per thread).
    """

    def __init__(self, reader: BatchReader, buffers: list[list[RowGroupRef]]) -> None:
        self._buffers = buffers
        self._shuffle = reader.shuffle
        self._sources = PerThread(
            lambda: RowGroupReader(reader.schema, reader.projection, reader.policies, new_decode_stats())
        )
        self._loads = ReadAhead(self._load, len(buffers), reader.read_ahead)

    def get(self, b: int) -> tuple[Columns, dict[str, int]]:
        """Buffer ``b``'s rows and the decode counter increments (raises what decoding raised)."""
        return self._loads.get(b)

    def ahead_rows(self) -> int:
        """Rows (footer counts) of the buffers being decoded ahead."""
        return sum(r.num_rows for a in self._loads.pending() for r in self._buffers[a])

    def close(self) -> None:
        """Cancels decodes not started, waits for running ones, closes the files."""
        self._loads.close()
        for source in self._sources.all():
            source.close()

    def _load(self, b: int) -> tuple[Columns, dict[str, int]]:
        source = self._sources.get()
        before = dict(source.stats)
        # Shuffled rows are gathered at random: row-major ids make that cache-friendly.
        parts = [source.read(ref) for ref in self._buffers[b]]
        cols = Columns.concat(parts, row_major_ids=self._shuffle)
        return cols, counter_increments(before, source.stats)


def _rows_of(cols: Columns, order: np.ndarray | None, start: int, stop: int) -> Columns:
    """Rows ``start .. stop-1`` of the buffer's read order."""
    return cols.slice(start, stop) if order is None else cols.take(order[start:stop])
