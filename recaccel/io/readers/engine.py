"""The engine both streaming readers run on: epoch order, sharding, position, counters.

A reader deals out *blocks* (row groups for :class:`BatchReader`, units of row groups
for :class:`TaskReader`): permuted with an RNG seeded by ``(seed, epoch, 0)`` when
shuffling, then dealt so that shard s of S takes the blocks at positions ``i % S == s``.
Its blocks are read, in that order, into buffers (or windows), whose items are permuted
with an RNG seeded by ``(seed, epoch, 1, shard, buffer)``; batches are cut from that
order. The engine owns these two permutations; a reader subclass owns what a block,
a buffer and a batch are (``_cut``).

Position. A reader is a cursor: iterating yields the batches from the current position
to the epoch's end and moves the position; ``state_dict()`` is the position just after
the last yielded batch: ``epoch``, the reader's position fields (``_KEYS``),
``epoch_done``, the settings and data it depends on (``_settings`` plus the dataset
sizes and policies) and the counters as they stand there (less those of input a resume
reads again). Once an epoch's last batch has been yielded the position says
``epoch_done`` and the next iteration runs epoch + 1.

::

    blocks 0..n-1 --permute(seed, epoch, 0)--> [b3 b0 b4 b1 b2 ...] --deal i % S == s-->
    shard s: [b3 b1 ...] --buffers--> buffer k --permute(seed, epoch, 1, s, k)--> batches
    state_dict(): {"epoch": e, <_KEYS>: ..., "epoch_done": bool, <settings>, "counters": {...}}
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from torch.utils.data import IterableDataset

from recaccel.errors import ConfigError
from recaccel.io.format.dataset import DatasetInfo, open_dataset
from recaccel.io.format.decode import new_decode_stats
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.state import data_fingerprint, restore_counters, restore_position, with_last

_STATE_VERSION = 1


@dataclass(frozen=True)
class Position:
    """Where a reader stands: ``epoch``, the reader's position fields (in ``_KEYS``
    order) and whether the epoch's last batch has been yielded."""

    epoch: int
    fields: tuple[int, ...]
    done: bool = False


def buffer_permutation(seed: int, epoch: int, shard: int, buffer: int, n: int) -> np.ndarray:
    """The shuffled read order of the ``n`` items of a buffer (what worker processes,
    which have no reader, compute too)."""
    return np.random.default_rng([seed, epoch, 1, shard, buffer]).permutation(n)


class ShardedReader(IterableDataset, ABC):
    """Base of the streaming readers (see the module docstring).

    Subclasses set ``_KEYS`` (state names of the position fields) and ``_WHAT`` (the
    reader's name in messages) and implement ``_cut``, ``_settings`` and
    ``num_batches``; they may override ``_end``.

    Args:
        path: a ``.parquet`` file or a directory of them.
        schema: expected schema; None = the one stored in the files.
        options: order, shard, policies and threads.
        counter_names: the reader's counters beyond the decode counters, in order.

    Attributes:
        info: the dataset footers (schema, files, row groups).
        schema: the dataset schema.
        options: the read options in effect.
        policies: ``options.policies``.
        counters: live counters; they count what this object did, batches cut one ahead
            included (the state carries those at its position).
    """

    _KEYS: ClassVar[tuple[str, ...]]
    _WHAT: ClassVar[str]

    def __init__(
        self,
        path: str | Path,
        schema: FeatureSchema | None,
        options: ReadOptions,
        counter_names: tuple[str, ...],
    ) -> None:
        self.options = options
        self.policies = options.policies
        self.info: DatasetInfo = open_dataset(path, schema, options.unreadable_files)
        self.schema = self.info.schema
        self.counters: dict[str, int] = new_decode_stats()
        self.counters.update(dict.fromkeys(counter_names, 0))
        self._pos = self._start(0)
        self._pos_counters = dict(self.counters)  # paired with _pos

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._pos.epoch + 1 if self._pos.done else self._pos.epoch

    @property
    @abstractmethod
    def num_batches(self) -> int | None:
        """Batches per epoch for a progress bar, or None when not known ahead."""

    def set_epoch(self, epoch: int) -> None:
        """Moves the position to the start of ``epoch`` (counters go on counting)."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        self._pos = self._start(epoch)
        self._pos_counters = dict(self.counters)

    def __iter__(self) -> Iterator[Any]:
        for batch, _ in self.iter_with_state():
            yield batch

    def iter_with_state(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Like iterating, but yields each batch with the state just after it.

        A prefetching loader runs ahead of the consumer; it should checkpoint the state
        paired with the last batch the trainer consumed, not ``state_dict()``.
        """
        if self._pos.done:
            self._pos = self._start(self._pos.epoch + 1)
        start = self._pos
        shard = self.options.shard.for_worker(mid_epoch=any(start.fields))
        cuts = self._cut(start, shard)
        try:
            for (batch, pos, counters), last in with_last(cuts):
                if last:  # the epoch is over: the state says done, every counter is final
                    pos, counters = self._end(pos), dict(self.counters)
                self._pos, self._pos_counters = pos, counters
                yield batch, self.state_dict()
            if not self._pos.done:  # an epoch without batches
                self._pos, self._pos_counters = self._end(self._pos), dict(self.counters)
        finally:
            cuts.close()

    def state_dict(self) -> dict[str, Any]:
        """The position after the last yielded batch, plus what it depends on and the
        counters at that position (JSON-able)."""
        p = self._pos
        return {
            "version": _STATE_VERSION,
            "epoch": p.epoch,
            **dict(zip(self._KEYS, p.fields, strict=True)),
            "epoch_done": p.done,
            **self._fingerprint,
            "counters": dict(self._pos_counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration resume at ``state`` (from :meth:`state_dict`).

        Raises:
            ConfigError: if the state is malformed or was taken with other settings
                (seed, shuffle, buffer size, rank, world size, read policies, ...).
            DataError: if it was taken on a dataset with other row groups.
        """
        keys = ("epoch", *self._KEYS)
        values, done = restore_position(state, _STATE_VERSION, self._fingerprint, keys, self._WHAT)
        restore_counters(state, self.counters, self._WHAT)
        position = Position(values[0], tuple(values[1:]), done)
        self._check_position(position)
        self._pos = position
        self._pos_counters = dict(self.counters)

    def _check_position(self, position: Position) -> None:
        """Refuses a loaded position that lies outside this reader's data, where that can
        be told without decoding (a reader may leave it to its iteration).

        Raises:
            DataError: naming the position and the data's bound.
        """

    def block_order(self, num_blocks: int, epoch: int, shard: tuple[int, int]) -> list[int]:
        """Indices of the blocks shard ``shard = (s, S)`` reads in ``epoch``, in order."""
        if self.options.shuffle:
            order = np.random.default_rng([self.options.seed, epoch, 0]).permutation(num_blocks)
        else:
            order = np.arange(num_blocks)
        index, count = shard
        return [int(i) for i in order[index::count]]

    def buffer_order(self, epoch: int, shard: int, buffer: int, n: int) -> np.ndarray | None:
        """The read order of the ``n`` items of buffer ``buffer`` (None = as they are)."""
        if not self.options.shuffle:
            return None
        return buffer_permutation(self.options.seed, epoch, shard, buffer, n)

    def note_held(self, rows: int) -> None:
        """Records ``rows`` held in memory in the ``max_buffered_rows`` high-water mark."""
        self.counters["max_buffered_rows"] = max(self.counters["max_buffered_rows"], rows)

    def _start(self, epoch: int) -> Position:
        return Position(epoch, (0,) * len(self._KEYS))

    def _end(self, pos: Position) -> Position:
        """The state after an epoch's last batch, from the position after it."""
        return Position(pos.epoch, pos.fields, True)

    @functools.cached_property
    def _fingerprint(self) -> dict[str, Any]:
        """Settings and dataset sizes: fixed for the reader's life, and put in every state
        (once per batch), so computed once."""
        return {**self._settings(), **data_fingerprint(self.info, self.policies)}

    @abstractmethod
    def _settings(self) -> dict[str, Any]:
        """The settings a saved position depends on (JSON-able, in state order)."""

    @abstractmethod
    def _cut(self, start: Position, shard: tuple[int, int]) -> Iterator[tuple[Any, Position, dict[str, int]]]:
        """Batches from ``start`` to the epoch's end of shard ``shard`` (see
        ``Shard.for_worker``), each with the position after it and the counters to pair
        with that position (see :func:`state.counters_at`)."""
