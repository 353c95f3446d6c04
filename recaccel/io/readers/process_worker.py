"""What a reader worker process runs (see :mod:`recaccel.io.readers.processes`).

A worker ignores SIGINT (the main process decides), shares the cores with the other
workers, then runs each job it is sent (``("job", job, two_phase)``, then item numbers
and, for a two-phase job, ``("go", item, argument)``) until told to stop (None) or its
pipe closes (the main process is gone); it unlinks its slots on the way out.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
from collections.abc import Iterator
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
    its argument, finish it), write the result to the next slot, send its layout."""
    worker = job.new_worker()

    def note(m: int) -> None:
        mark[0] = m

    try:
        for n, i in enumerate(inbox.items()):  # slot n % slots: the iteration began with all free
            mark[0] = -1
            try:
                result = job.load(worker, i, note)
                if two_phase:
                    conn.send(("size", i, job.size(result)))
                    result = job.finish(result, i, inbox.argument(i))
                layout = writer.write(n % slots, result)
                result = None  # copied out: not held while the next item loads or while idle
            except _Stop:
                raise
            except Exception as exc:  # noqa: BLE001 (sent back, raised by the main process)
                conn.send(("error", i, (_portable(exc), mark[0])))
            else:
                conn.send(("ok", i, layout))
    finally:
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
            elif not _stale(message):
                self._queued.appendleft(message)
                return

    def argument(self, i: int) -> Any:
        """Item ``i``'s argument (items sent meanwhile are queued)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                raise _Stop from None
            if message is None:
                raise _Stop
            if isinstance(message, int):
                self._queued.append(message)
            elif message[1] == i:  # arguments come in item order; an earlier one is stale
                return message[2]


def _stale(message: Any) -> bool:
    """Whether ``message`` is the argument of an item whose load failed before asking."""
    return isinstance(message, tuple) and message[0] == "go"


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a one-line stand-in (which the main process
    reports with the file and row group)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 (any pickling failure)
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
