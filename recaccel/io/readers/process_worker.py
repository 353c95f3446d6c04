"""What a reader worker process runs (see :mod:`recaccel.io.readers.processes`).

A worker ignores SIGINT (the main process decides), shares the cores with the other
workers, then runs each job it is sent (``("job", job, two_phase)``, then item numbers
and, for a two-phase job, ``("go", item, argument)``) until told to stop (None) or its
pipe closes (the main process is gone); it unlinks its slots on the way out.

Overlap. While a worker finishes item i (waits for its argument, cuts it, writes it to its
slot), a thread of its own already loads the next item sent to it, if one is waiting in
its pipe: Arrow's read releases the GIL, so one worker keeps about two cores busy (the
loads themselves stay one at a time, in item order, so counters and errors are as before).
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import pyarrow
import torch

from recaccel.io.readers.shm_ring import SlotWriter


def serve(conn: Connection, mark: Any, prefix: str, slots: int, workers: int) -> None:
    """A worker's life: run each job sent until told to stop (or the main process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _share_cores(workers)
    writer = SlotWriter(prefix, slots)
    inbox = _Inbox(conn)
    try:
        while (order := inbox.next_job()) is not None:
            _, job, two_phase = order
            _run(job, two_phase, inbox, conn, writer, mark, slots)
    except (_Stop, BrokenPipeError, ConnectionResetError):  # told to stop, or the main process is gone
        pass
    finally:
        writer.close()


def _run(
    job: Any, two_phase: bool, inbox: _Inbox, conn: Connection, writer: SlotWriter, mark: Any, slots: int
) -> None:
    """One iteration: load each item sent (for a two-phase job: report its size, wait for
    its argument, finish it), write the result to the next slot, send its layout; the
    next item waiting in the pipe is loaded meanwhile (module docstring)."""
    worker = job.new_worker()
    loads = ThreadPoolExecutor(1, thread_name_prefix="reader-load")
    ahead: tuple[int, Future] | None = None

    def load(i: int) -> Future:
        def note(m: int) -> None:
            mark[0] = m

        def run() -> Any:
            mark[0] = -1
            return job.load(worker, i, note)

        return loads.submit(run)

    try:
        for n, i in enumerate(inbox.items()):  # slot n % slots: the iteration began with all free
            loading = ahead[1] if ahead is not None and ahead[0] == i else load(i)
            ahead = None
            at = None  # the block a failure names: the load's mark, then -1 (the whole item)
            try:
                result = loading.result()
                at = -1  # the next load, started below, moves the mark
                if two_phase:
                    conn.send(("size", i, job.size(result)))
                following = inbox.waiting_item()
                if following is not None:
                    ahead = (following, load(following))
                if two_phase:
                    result = job.finish(result, i, inbox.argument(i))
                layout = writer.write(n % slots, result)
                result = None  # copied out: not held while the next item loads or while idle
            except _Stop:
                raise
            except Exception as exc:  # noqa: BLE001 (sent back, raised by the main process)
                conn.send(("error", i, (_portable(exc), mark[0] if at is None else at)))
            else:
                conn.send(("ok", i, layout))
    finally:
        if ahead is not None:
            ahead[1].cancel()
        loads.shutdown(wait=True)  # a load under way ends before its reader closes
        worker.close()


def _share_cores(workers: int) -> None:
    """Gives each of ``workers`` processes its share of the cores for Arrow's thread pool,
    so N workers do not run N times as many threads as there are cores, and torch one
    thread: a worker's torch work is copies, and idle OpenMP threads spin."""
    pyarrow.set_cpu_count(max(1, (os.cpu_count() or 1) // workers))
    torch.set_num_threads(1)


class _Stop(Exception):
    """The main process said stop, or is gone."""


class _Inbox:
    """A worker's messages: ("job", job, two_phase), then item numbers to load and
    ("go", item, argument); None = stop."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queued: collections.deque[Any] = collections.deque()

    def _next(self) -> Any:
        if self._queued:
            return self._queued.popleft()
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def next_job(self) -> tuple[str, Any, bool] | None:
        """The next job message; None = stop."""
        return self._next()

    def items(self) -> Iterator[int]:
        """The current job's items, in order, until the next job or a stop (kept)."""
        while True:
            message = self._next()
            if isinstance(message, int):
                yield message
            elif not _is_argument(message):
                self._queued.appendleft(message)
                return

    def waiting_item(self) -> int | None:
        """The next item of the current job if it is already here (queued or in the pipe),
        without waiting; it stays next in line."""
        if not self._queued:
            try:
                if not self._conn.poll():
                    return None
                self._queued.append(self._conn.recv())
            except (EOFError, OSError):
                return None  # the main process is gone: the next read says so
        first = self._queued[0]
        return first if isinstance(first, int) else None

    def argument(self, i: int) -> Any:
        """Item ``i``'s argument: the first ``("go", i, ...)`` queued or received (earlier,
        stale arguments dropped); the items and messages passed meanwhile stay queued in
        order."""
        passed: collections.deque[Any] = collections.deque()
        try:
            while True:
                message = self._queued.popleft() if self._queued else self._receive()
                if message is None:
                    raise _Stop
                if _is_argument(message):
                    if message[1] == i:  # arguments come in item order; an earlier one is stale
                        return message[2]
                    continue
                passed.append(message)
        finally:
            self._queued.extendleft(reversed(passed))

    def _receive(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise _Stop from None


def _is_argument(message: Any) -> bool:
    """Whether ``message`` is an item's argument, ``("go", item, argument)`` (one that
    reaches :meth:`_Inbox.items` is stale: its item's load failed before asking)."""
    return isinstance(message, tuple) and message[0] == "go"


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a one-line stand-in (which the main process
    reports with the file and row group)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 (any pickling failure)
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
