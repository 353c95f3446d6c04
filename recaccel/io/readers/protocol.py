"""The Reader protocol: what a trainer, a device loader or a rank slicer may ask of a reader.

Both :class:`~recaccel.io.readers.rows.BatchReader` and
:class:`~recaccel.io.readers.tasks.TaskReader` implement it, and so does anything that
wraps one (the hybrid trainer's per-rank slicer). Callers use these members only, never
``getattr`` probing.

A reader is a cursor over an epoch: iterating yields the batches from the current
position to the epoch's end and moves the position; ``state_dict()`` is the position
just after the last yielded batch (JSON-able, with the counters as they stand there),
and a reader given that state by ``load_state_dict`` continues exactly from it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from recaccel.sparse import Batch, TaskBatch


@runtime_checkable
class Reader(Protocol):
    """A resumable, epoch-aware stream of :class:`Batch` or :class:`TaskBatch`."""

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        ...

    @property
    def counters(self) -> dict[str, int]:
        """Live counters (rows and batches yielded, rows skipped by policy, ...)."""
        ...

    @property
    def num_batches(self) -> int | None:
        """Batches per epoch for a progress bar, or None when not known ahead."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """Moves the position to the start of ``epoch``."""
        ...

    def __iter__(self) -> Iterator[Batch | TaskBatch]: ...

    def iter_with_state(self) -> Iterator[tuple[Batch | TaskBatch, dict[str, Any]]]:
        """Each batch with the state just after it (what a prefetching loader hands on)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
