"""Decoding numbered items in worker processes, results back in order through shared memory.

:class:`ProcessLoader` is the process counterpart of
:class:`~recaccel.io.readers.read_ahead.WorkerLoader`: item ``i`` (a shuffle buffer, a
unit of row groups) is decoded by worker ``i % N`` with a :class:`Job`, its result
copied into one of that worker's shared-memory slots (:mod:`shm_ring`) and copied out
by the main process when ``get(i)`` asks for it. The items and their order are those of
the in-process path, so every batch cut from them is too.

Flow. ``get(i)`` sends items ``i .. i + ahead`` to their workers (each once), then waits
for item ``i``. A worker has at most ``ceil((ahead + 1) / N)`` items in flight, and one
slot more than that, so a slot is never rewritten before the main process copied it
out: no acknowledgements are needed.

Failures. A load that raises sends its exception back, raised by ``get`` of that item
(a :class:`~recaccel.errors.RecaccelError` as it is, anything else as one line naming
the file and row group). A worker that dies is found by its process sentinel while the
main process waits: a :class:`ReaderWorkerError` naming the file and row group it was
decoding. Workers ignore SIGINT (the main process decides), exit when their pipe closes
(the main process died) and unlink their slots on the way out; ``close()`` (also run at
garbage collection) stops them and unlinks whatever a killed worker left.

Workers start from a ``forkserver`` (``spawn`` where there is none): never ``fork``, as
the main process has torch and threads running.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, Protocol, TypeVar

from recaccel.errors import RecaccelError
from recaccel.io.readers.shm_ring import SlotReader, SlotWriter, unlink_prefix

log = logging.getLogger(__name__)

S = TypeVar("S")
T = TypeVar("T")

_JOIN_S = 2.0  # how long close() waits for a worker before killing it
_POLL_S = 1.0  # how often a waiting get() looks at the worker's liveness


class ReaderWorkerError(RecaccelError):
    """A reader worker process died or failed outside the read policies."""


class Job(Protocol[S, T]):
    """What a worker process runs (picklable: it travels to the worker once)."""

    def new_worker(self) -> S:
        """The worker's reading state (file handles, counters); it has ``close()``."""
        ...

    def load(self, worker: S, i: int, note: Callable[[int], None]) -> T:
        """Item ``i``; calls ``note(mark)`` before each block it reads (see ``where``)."""
        ...

    def where(self, i: int, mark: int) -> str:
        """The file and row group(s) of item ``i`` (block ``mark``; -1 = not known)."""
        ...


def _context() -> mp.context.BaseContext:
    """The forkserver (spawn where there is none). The server imports the readers (torch,
    pyarrow, pandas) once, so a worker starts in milliseconds rather than seconds."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # pandas: pyarrow imports it on a worker's first read (missing ones are skipped).
    ctx.set_forkserver_preload(["recaccel.io.readers", "pandas"])  # no effect once the server runs
    return ctx


class ProcessLoader(Generic[S, T]):
    """Items ``0 .. count-1`` loaded by ``job`` in ``workers`` processes, ``ahead`` in advance.

    Args:
        job: what each worker runs.
        count: number of items.
        ahead: items loaded in advance (at least ``workers``, so every worker is busy).
        workers: worker processes (>= 1).
    """

    def __init__(self, job: Job[S, T], count: int, ahead: int, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._job = job
        self._count = count
        self._ahead = max(ahead, workers)
        self._n = workers
        self._prefix = f"rca{os.getpid()}x{secrets.token_hex(3)}"
        slots = -(-(self._ahead + 1) // workers) + 1
        ctx = _context()
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._marks = []
        self._reader = SlotReader()
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, self._reader, self._prefix)
        for k in range(workers):
            mine, theirs = ctx.Pipe()
            mark = ctx.Array("q", 1, lock=False)
            mark[0] = -1
            proc = ctx.Process(
                target=_serve,
                args=(job, theirs, mark, f"{self._prefix}w{k}", slots),
                name=f"recaccel-reader-{k}",
                daemon=True,
            )
            proc.start()
            theirs.close()  # the worker sees EOF once this process's end closes
            self._procs.append(proc)
            self._conns.append(mine)
            self._marks.append(mark)
        self._sent = -1  # the highest item sent to a worker
        self._taken = -1  # the highest item handed out

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [p.pid for p in self._procs if p.pid is not None]

    def get(self, i: int) -> T:
        """Item ``i`` (items are asked for in increasing order; raises what its load raised)."""
        if i <= self._taken or i >= self._count:
            raise ValueError(f"item {i} asked for after item {self._taken} of {self._count}")
        self._sent = max(self._sent, i - 1)  # a resume starts mid-way
        for j in range(self._sent + 1, min(i + 1 + self._ahead, self._count)):
            try:
                self._conns[j % self._n].send(j)
            except OSError:  # the worker is gone
                raise self._died(j) from None
            self._sent = j
        self._taken = i
        return self._receive(i)

    def pending(self) -> list[int]:
        """Items sent to workers and not yet handed out (for memory accounting)."""
        return list(range(self._taken + 1, self._sent + 1))

    def close(self) -> None:
        """Stops the workers and unlinks their shared memory."""
        self._finalizer()

    def _receive(self, i: int) -> T:
        k = i % self._n
        conn, proc = self._conns[k], self._procs[k]
        while not conn.poll():
            if proc.sentinel in wait([conn, proc.sentinel], timeout=_POLL_S) and not conn.poll():
                raise self._died(i)
        try:
            kind, j, payload = conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError):  # killed while sending
            raise self._died(i) from None
        if j != i:
            raise ReaderWorkerError(f"reader worker {k} sent item {j} when item {i} was due")
        if kind == "ok":
            return self._reader.read(payload)
        exc, mark = payload
        if isinstance(exc, RecaccelError):
            raise exc
        raise ReaderWorkerError(f"reader worker {k} failed decoding {self._job.where(i, mark)}: {exc}")


    def _died(self, i: int) -> ReaderWorkerError:
        """The error for worker ``i % N`` found dead while item ``i`` was due from it."""
        k = i % self._n
        proc = self._procs[k]
        proc.join(_JOIN_S)
        mark = self._marks[k][0]
        return ReaderWorkerError(
            f"reader worker {k} (pid {proc.pid}) died (exit code {proc.exitcode}) while decoding "
            f"{self._job.where(i, mark)}"
        )


def _shutdown(procs: list, conns: list[Connection], reader: SlotReader, prefix: str) -> None:
    """Stops the workers (asks, then terminates, then kills) and unlinks their segments."""
    for conn in conns:
        try:
            conn.send(None)
        except OSError:  # the worker is gone
            pass
    for proc in procs:
        proc.join(_JOIN_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    reader.close()
    unlink_prefix(prefix)


def _serve(job: Job, conn: Connection, mark: Any, prefix: str, slots: int) -> None:
    """A worker's loop: load each item sent, write it to the next slot, send its layout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    writer = SlotWriter(prefix, slots)
    worker = job.new_worker()

    def note(m: int) -> None:
        mark[0] = m

    try:
        for i, slot in _items(conn, slots):
            mark[0] = -1
            try:
                result = writer.write(slot, job.load(worker, i, note))
            except Exception as exc:  # noqa: BLE001 (sent back, raised by the main process)
                conn.send(("error", i, (_portable(exc), mark[0])))
            else:
                conn.send(("ok", i, result))
    except (BrokenPipeError, ConnectionResetError):  # the main process is gone
        pass
    finally:
        worker.close()
        writer.close()


def _items(conn: Connection, slots: int) -> Iterator[tuple[int, int]]:
    """(item, slot) for each item the main process sends, until it says stop or is gone;
    slots are used in turn."""
    sent = 0
    while True:
        try:
            i = conn.recv()
        except (EOFError, OSError):
            return
        if i is None:
            return
        yield i, sent % slots
        sent += 1


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a one-line stand-in."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 (any pickling failure)
        return ReaderWorkerError(f"{type(exc).__name__}: {exc}")
    return exc
