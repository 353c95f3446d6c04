"""Measuring how long a training loop waits for its batches."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class DataWait:
    """Host time spent blocked in ``next()`` on a batch source.

    The first batch of each pass is counted apart as start-up (worker threads start,
    the first buffers are decoded); the rest is the steady-state stall that a faster
    input pipeline removes. On a GPU the host runs ahead of the device, so time blocked
    here is time the device had no next step queued once the host caught up with it.

    Attributes:
        seconds: steady-state wait (every batch after a pass's first, and each pass's end).
        startup_seconds: wait for the first batch of each pass.
        batches: batches handed out.

    Args:
        clock: seconds from a monotonic clock (tests pass a simulated one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.seconds = 0.0
        self.startup_seconds = 0.0
        self.batches = 0

    def wrap(self, batches: Iterable[T]) -> Iterator[T]:
        """Yields ``batches``, timing each ``next()``."""
        it = iter(batches)
        first = True
        while True:
            start = self._clock()
            try:
                batch = next(it)
            except StopIteration:
                self.seconds += self._clock() - start
                return
            waited = self._clock() - start
            if first:
                self.startup_seconds += waited
                first = False
            else:
                self.seconds += waited
            self.batches += 1
            yield batch

    def fraction(self, train_seconds: float) -> float:
        """Steady-state wait over the steady-state training time (``train_seconds``
        including start-up), 0 when nothing ran."""
        steady = train_seconds - self.startup_seconds
        return self.seconds / steady if steady > 0 else 0.0
