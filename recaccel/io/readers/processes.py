"""Decoding numbered items in worker processes, results back in order through shared memory.

:class:`ProcessLoader` is the process counterpart of
:class:`~recaccel.io.readers.read_ahead.WorkerLoader`: item ``i`` (a shuffle buffer, a
unit of row groups) is decoded by worker ``i % N`` with a :class:`Job`, its result
copied into one of that worker's shared-memory slots (:mod:`shm_ring`) and copied out
by the main process when ``get(i)`` asks for it. The items and their order are those of
the in-process path, so every batch cut from them is too.

Flow. ``get(i)`` sends items ``i .. i + ahead`` to their workers (each once), then waits
for item ``i``, copying out every result that arrives meanwhile. A worker has at most
``ceil((ahead + 1) / N)`` items in flight, and one slot more than that, so a slot is
never rewritten before the main process copied it out: no acknowledgements are needed.
A two-phase job (a :class:`Plan`) reports each item's size after loading it and waits
for an argument computed from the sizes of the items before it: how a worker cutting
batches learns the rows carried into its buffer while the buffers before it are still
being decoded elsewhere.

Threads. Each worker gives Arrow's thread pool its share of the cores, torch one thread.

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

import collections
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import pyarrow
import torch

from recaccel.errors import ConfigError, RecaccelError
from recaccel.io.readers.shm_ring import SlotReader, SlotWriter, unlink_prefix

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


class Plan(NamedTuple):
    """A two-phase job's argument chain: item ``first`` gets ``initial``, item ``i + 1``
    gets ``step(argument of i, size of i)``, where a worker reports an item's size
    (``job.size(loaded)``) right after loading it and then waits for its argument to
    finish it (``job.finish(loaded, i, argument)``). How a batch cutter learns the rows
    a buffer carries over from the buffers before it, which other workers decode."""

    first: int
    initial: Any
    step: Callable[[Any, Any], Any]


class ProcessLoader(Generic[S, T]):
    """Items ``0 .. count-1`` loaded by ``job`` in ``workers`` processes, ``ahead`` in advance.

    Args:
        job: what each worker runs.
        count: number of items.
        ahead: items loaded in advance (at least ``workers``, so every worker is busy).
        workers: worker processes (>= 1).
        plan: for a two-phase job (``size`` and ``finish``), its argument chain.
    """

    def __init__(
        self, job: Job[S, T], count: int, ahead: int, workers: int, plan: Plan | None = None
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if mp.current_process().daemon:
            raise ConfigError(
                "data.workers > 0 cannot start reader processes inside a daemonic process "
                "(a torch DataLoader worker); use data.workers = 0 there"
            )
        self._job = job
        self._count = count
        self._ahead = max(ahead, workers)
        self._n = workers
        self._plan = plan
        self._prefix = f"rca{os.getpid()}x{secrets.token_hex(3)}"
        slots = -(-(self._ahead + 1) // workers) + 1
        ctx = _context()
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._marks = []
        self._reader = SlotReader()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._procs, self._conns, self._reader, self._prefix
        )
        for k in range(workers):
            mine, theirs = ctx.Pipe()
            mark = ctx.Array("q", 1, lock=False)
            mark[0] = -1
            proc = ctx.Process(
                target=_serve,
                args=(job, theirs, mark, f"{self._prefix}w{k}", slots, plan is not None, workers),
                name=f"reader-worker-{k}",
                daemon=True,
            )
            proc.start()
            theirs.close()  # the worker sees EOF once this process's end closes
            self._procs.append(proc)
            self._conns.append(mine)
            self._marks.append(mark)
        self._sent = -1  # the highest item sent to a worker
        self._taken = -1  # the highest item handed out
        self._done: dict[int, tuple[str, Any]] = {}  # received, not yet handed out
        self._sizes: dict[int, Any] = {}
        self._arg_at: tuple[int, Any] = (plan.first, plan.initial) if plan else (0, None)
        self._go_sent = -1  # the highest item sent its argument

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
            self._send(j, j)
            self._sent = j
        self._taken = i
        self._advance()
        while i not in self._done:
            self._pump(i)
        kind, payload = self._done.pop(i)
        if kind == "ok":
            return payload
        exc, mark = payload
        if isinstance(exc, RecaccelError):
            raise exc
        raise ReaderWorkerError(
            f"reader worker {i % self._n} failed decoding {self._job.where(i, mark)}: {exc}"
        )

    def pending(self) -> list[int]:
        """Items sent to workers and not yet handed out (for memory accounting)."""
        return list(range(self._taken + 1, self._sent + 1))

    def close(self) -> None:
        """Stops the workers and unlinks their shared memory."""
        self._finalizer()

    def _send(self, j: int, message: Any) -> None:
        try:
            self._conns[j % self._n].send(message)
        except OSError:  # the worker is gone
            raise self._died(j) from None

    def _advance(self) -> None:
        """Sends each two-phase item its argument once it was sent and the argument is known
        (from the size of the item before it)."""
        while self._plan is not None:
            j, arg = self._arg_at
            if j >= self._count or j > self._sent:
                return
            if self._go_sent < j:
                self._send(j, ("go", j, arg))
                self._go_sent = j
            if j not in self._sizes:
                return
            self._arg_at = (j + 1, self._plan.step(arg, self._sizes.pop(j)))

    def _pump(self, i: int) -> None:
        """Receives what the workers sent (copying results out of their slots); raises if a
        worker owing an item died."""
        owing = {j % self._n for j in range(i, self._sent + 1) if j not in self._done}
        ready = wait(
            [self._conns[k] for k in owing] + [self._procs[k].sentinel for k in owing], timeout=_POLL_S
        )
        for k in owing:
            conn = self._conns[k]
            while conn.poll():
                try:
                    kind, j, payload = conn.recv()
                except (EOFError, OSError, pickle.UnpicklingError):  # killed while sending
                    raise self._died(self._oldest(k)) from None
                self._take(kind, j, payload)
            if self._procs[k].sentinel in ready and not conn.poll():
                raise self._died(self._oldest(k))

    def _take(self, kind: str, j: int, payload: Any) -> None:
        if kind == "size":
            self._sizes[j] = payload
            self._advance()
        elif kind == "ok":
            self._done[j] = ("ok", self._reader.read(payload))
        else:
            self._done[j] = ("error", payload)

    def _died(self, i: int) -> ReaderWorkerError:
        """The error for worker ``i % N``, found dead while it owed item ``i``."""
        k = i % self._n
        proc = self._procs[k]
        proc.join(_JOIN_S)
        return ReaderWorkerError(
            f"reader worker {k} (pid {proc.pid}) died (exit code {proc.exitcode}) while decoding "
            f"{self._job.where(i, self._marks[k][0])}"
        )

    def _oldest(self, k: int) -> int:
        """The first item worker ``k`` owes."""
        return min(j for j in range(self._taken, self._sent + 1) if j % self._n == k and j not in self._done)


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


def _serve(
    job: Any, conn: Connection, mark: Any, prefix: str, slots: int, two_phase: bool, workers: int
) -> None:
    """A worker's loop: load each item sent (for a two-phase job: report its size, wait for
    its argument, finish it), write the result to the next slot, send its layout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _share_cores(workers)
    writer = SlotWriter(prefix, slots)
    worker = job.new_worker()
    inbox = _Inbox(conn)

    def note(m: int) -> None:
        mark[0] = m

    try:
        for n, i in enumerate(inbox.items()):
            mark[0] = -1
            try:
                result = job.load(worker, i, note)
                if two_phase:
                    conn.send(("size", i, job.size(result)))
                    result = job.finish(result, i, inbox.argument(i))
                layout = writer.write(n % slots, result)
            except _Stop:
                return
            except Exception as exc:  # noqa: BLE001 (sent back, raised by the main process)
                conn.send(("error", i, (_portable(exc), mark[0])))
            else:
                conn.send(("ok", i, layout))
    except (BrokenPipeError, ConnectionResetError):  # the main process is gone
        pass
    finally:
        worker.close()
        writer.close()


def _share_cores(workers: int) -> None:
    """Gives each of ``workers`` processes its share of the cores for Arrow's thread pool,
    so N workers do not run N times as many threads as there are cores, and torch one
    thread: a worker's torch work is copies, and idle OpenMP threads spin."""
    pyarrow.set_cpu_count(max(1, (os.cpu_count() or 1) // workers))
    torch.set_num_threads(1)


class _Stop(Exception):
    """The main process said stop, or is gone."""


class _Inbox:
    """A worker's messages: item numbers to load, ("go", item, argument), None = stop."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queued: collections.deque[int] = collections.deque()

    def _next(self) -> Any:
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            raise _Stop from None
        if message is None:
            raise _Stop
        return message

    def items(self) -> Iterator[int]:
        """The items to load, in order, until told to stop."""
        while True:
            try:
                yield self._queued.popleft() if self._queued else self._next()
            except _Stop:
                return

    def argument(self, i: int) -> Any:
        """Item ``i``'s argument (items sent meanwhile are queued)."""
        while True:
            message = self._next()
            if isinstance(message, tuple):
                assert message[1] == i, (message, i)  # arguments come in item order
                return message[2]
            self._queued.append(message)


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a one-line stand-in."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 (any pickling failure)
        return ReaderWorkerError(f"{type(exc).__name__}: {exc}")
    return exc
