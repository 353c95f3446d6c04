"""Loading numbered items ahead of the consumer on worker threads, results in order."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")


class PerThread(Generic[S]):
    """One ``make()`` object per thread (file handles, counters), made on first use."""

    def __init__(self, make: Callable[[], S]) -> None:
        self._make = make
        self._local = threading.local()
        self._made: list[S] = []
        self._lock = threading.Lock()

    def get(self) -> S:
        """This thread's object."""
        obj = getattr(self._local, "obj", None)
        if obj is None:
            obj = self._local.obj = self._make()
            with self._lock:
                self._made.append(obj)
        return obj

    def all(self) -> list[S]:
        """Every object made so far (to close them, or read their state)."""
        with self._lock:
            return list(self._made)


class ReadAhead(Generic[T]):
    """Calls ``load(i)`` for items ``0 .. count-1`` as they are asked for, and the next
    ``ahead`` items in advance, one worker thread each.

    An item's result (or the exception its load raised) comes back when it is asked for,
    so results and errors are those of loading inline; ``ahead = 0`` loads inline.
    """

    def __init__(
        self, load: Callable[[int], T], count: int, ahead: int, *, name: str = "recaccel-read"
    ) -> None:
        self._load = load
        self._count = count
        self._ahead = max(0, ahead)
        self._pool = ThreadPoolExecutor(self._ahead, thread_name_prefix=name) if self._ahead else None
        self._futures: dict[int, Future] = {}

    def get(self, i: int) -> T:
        """Item ``i`` (raises what its load raised)."""
        if self._pool is None:
            return self._load(i)
        fut = self._futures.pop(i, None) or self._pool.submit(self._load, i)
        for j in range(i + 1, min(i + 1 + self._ahead, self._count)):
            if j not in self._futures:
                self._futures[j] = self._pool.submit(self._load, j)
        return fut.result()

    def pending(self) -> list[int]:
        """Items being loaded ahead (for memory accounting)."""
        return list(self._futures)

    def close(self) -> None:
        """Cancels loads not started and waits for running ones."""
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class WorkerLoader(Generic[S, T]):
    """Items ``0 .. count-1`` loaded by ``load(worker, i)``, ``ahead`` of them in advance.

    Each thread gets its own worker from ``new_worker()`` (file handles, counters), so
    loads share nothing mutable; ``close()`` stops the loads and closes every worker.

    Args:
        new_worker: makes one thread's worker (it has ``close()``).
        load: loads item ``i`` with the calling thread's worker.
        count: number of items.
        ahead: items loaded in advance on that many threads; 0 = load on request.
        name: the worker threads' name prefix.
    """

    def __init__(
        self,
        new_worker: Callable[[], S],
        load: Callable[[S, int], T],
        count: int,
        ahead: int,
        *,
        name: str = "recaccel-read",
    ) -> None:
        self.workers = PerThread(new_worker)
        self._loads = ReadAhead(lambda i: load(self.workers.get(), i), count, ahead, name=name)

    def get(self, i: int) -> T:
        """Item ``i`` (raises what its load raised)."""
        return self._loads.get(i)

    def pending(self) -> list[int]:
        """Items being loaded ahead (for memory accounting)."""
        return self._loads.pending()

    def close(self) -> None:
        """Cancels loads not started, waits for running ones, closes the workers."""
        self._loads.close()
        for worker in self.workers.all():
            worker.close()
