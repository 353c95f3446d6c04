"""Decoding numbered items in worker processes that live across epochs, results back in
order through shared memory.

:class:`WorkerPool` is N worker processes, each with a pipe and its shared-memory slots
(:mod:`shm_ring`). A reader keeps one (:func:`pool_for`): started on the first iteration
that needs it, reused by every following iteration (epoch) of that reader, so an epoch
boundary costs one small message per worker rather than N process starts. A
:class:`ProcessLoader` is one iteration's use of a pool: it sends every worker the
iteration's :class:`Job` (pickled once) and then item numbers; item ``i`` (a shuffle
buffer, a unit of row groups) is decoded by worker ``i % N``, its result copied into one
of that worker's slots and copied out by the main process when ``get(i)`` asks for it.
The items and their order are those of the in-process path, so every batch cut from
them is too.

Flow. ``get(i)`` sends items ``i .. i + ahead`` to their workers (each once), then waits
for item ``i``, copying out every result that arrives meanwhile. A worker has at most
``ceil((ahead + 1) / N)`` items in flight, and one slot more than that, so a slot is
never rewritten before the main process copied it out: no acknowledgements are needed.
A two-phase job (a :class:`Plan`) reports each item's size after loading it and waits
for an argument computed from the sizes of the items before it: how a worker cutting
batches learns the rows carried into its buffer while the buffers before it are still
being decoded elsewhere.

Life. An iteration that ends with nothing in flight (every item it sent handed out, no
error) leaves the pool idle for the next one; any other end (an early ``break``, an
exception, a worker error) closes it, and the next iteration starts a new one. A pool is
stopped, and its segments unlinked, when its reader is garbage-collected, at interpreter
exit, or when the main process dies (each worker exits when its pipe closes). A pool
whose worker died while idle is replaced.

Threads. Each worker gives Arrow's thread pool its share of the cores, torch one thread
(:mod:`recaccel.io.readers.process_worker`: the worker's side).

Failures. A load that raises sends its exception back, raised by ``get`` of that item
(a :class:`~recaccel.errors.RecaccelError` as it is, anything else as one line naming
the file and row group). A worker that dies is found by its process sentinel while the
main process waits: a :class:`ReaderWorkerError` naming the file and row group it was
decoding. Workers ignore SIGINT (the main process decides). A SIGINT (Ctrl-C) arriving
while a pool's processes start or stop is held back until the pool is consistent and
its finalizer registered (:mod:`recaccel.io.readers.interrupts`), then raised, so the
``KeyboardInterrupt`` never cuts the forkserver handshake or a shutdown short.

Workers start from a ``forkserver`` (``spawn`` where there is none): never ``fork``, as
the main process has torch and threads running.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import secrets
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from recaccel.errors import ConfigError, RecaccelError
from recaccel.io.readers.interrupts import sigint_deferred
from recaccel.io.readers.process_worker import serve
from recaccel.io.readers.shm_ring import SlotReader, unlink_prefix

logger = logging.getLogger(__name__)

S = TypeVar("S")
T = TypeVar("T")

_JOIN_S = 2.0  # how long a shutdown waits for a worker before killing it
_POLL_S = 1.0  # how often a waiting get() looks at the worker's liveness


class ReaderWorkerError(RecaccelError):
    """A reader worker process died or failed outside the read policies."""


class Job(Protocol[S, T]):
    """What a worker process runs for one iteration (picklable: sent to each worker once)."""

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


class WorkerPool:
    """``workers`` reader processes with ``slots`` shared-memory slots each, started on
    the first :meth:`begin` and kept until :meth:`close` (or garbage collection)."""

    def __init__(self, workers: int, slots: int) -> None:
        self.workers = workers
        self.slots = slots
        self.prefix = f"rca{os.getpid()}x{secrets.token_hex(3)}"
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.marks: list[Any] = []  # per worker: the block it is reading (see Job.where)
        self.reader = SlotReader()
        self.busy = False  # an iteration is using it
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(
            self, _shutdown, self.procs, self.conns, self.reader, self.prefix, self._pid
        )

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [p.pid for p in self.procs if p.pid is not None]

    @property
    def open(self) -> bool:
        """Whether the pool was not closed yet."""
        return self._finalizer.alive

    def fits(self, workers: int, slots: int) -> bool:
        """Whether an iteration wanting ``workers`` x ``slots`` can use this pool now:
        open, idle, of this process, that size, every worker alive."""
        return (
            self.open
            and not self.busy
            and self._pid == os.getpid()
            and (self.workers, self.slots) == (workers, slots)
            and not any(self.dead())
        )

    def dead(self) -> list[int]:
        """The pids of workers found dead: their pipe closed (an idle worker sends nothing,
        and its end closes once all its threads have exited, before the forkserver reports
        its exit). A worker dying at this very moment may still look alive: the iteration
        then fails with the one-line dead-worker error, as for a death mid-epoch."""
        return [
            p.pid for p, c in zip(self.procs, self.conns, strict=False) if c.poll() or p.exitcode is not None
        ]

    def begin(self, job: Job, two_phase: bool) -> None:
        """Starts the processes if they are not running, then sends each worker ``job``."""
        self.busy = True
        if not self.procs:
            self._start()
        message = ForkingPickler.dumps(("job", job, two_phase))
        for k, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError:  # died since fits() looked
                proc = self.procs[k]
                raise ReaderWorkerError(
                    f"reader worker {k} (pid {proc.pid}) died (exit code {proc.exitcode}) between iterations"
                ) from None

    def release(self) -> None:
        """Marks the pool idle: its iteration handed out everything it sent."""
        self.busy = False

    def close(self) -> None:
        """Stops the workers and unlinks their shared memory."""
        with sigint_deferred():  # a finalizer runs once: a Ctrl-C must not cut it short
            self._finalizer()

    def _start(self) -> None:
        """Starts the processes with SIGINT held back (see the module docstring)."""
        ctx = _context()
        with sigint_deferred():
            for k in range(self.workers):
                mine, theirs = ctx.Pipe()
                self.conns.append(mine)  # first: a failed start still closes it
                mark = ctx.Array("q", 1, lock=False)
                mark[0] = -1
                proc = ctx.Process(
                    target=serve,
                    args=(theirs, mark, f"{self.prefix}w{k}", self.slots, self.workers),
                    name=f"reader-worker-{k}",
                    daemon=True,
                )
                proc.start()
                theirs.close()  # the worker sees EOF once this process's end closes
                self.procs.append(proc)
                self.marks.append(mark)


# Each owner's (reader's) pool: weak keys, so a collected reader drops its pool, whose
# finalizer then stops it; outside the reader, which stays picklable.
_POOLS: weakref.WeakKeyDictionary[Any, WorkerPool] = weakref.WeakKeyDictionary()


def pool_for(owner: Any, workers: int, slots: int) -> WorkerPool:
    """The idle pool ``owner`` keeps, or a new one it keeps from now on (None: a pool
    of the caller's own). A pool still busy with an abandoned iteration stays with that
    iteration, which closes it; one unfit otherwise (a dead worker) is closed."""
    pool = _POOLS.get(owner) if owner is not None else None
    if pool is not None and pool.fits(workers, slots):
        return pool
    if pool is not None and not pool.busy:
        dead = pool.dead() if pool.open else []
        if dead:
            logger.warning("reader worker(s) %s died between iterations; starting new ones", dead)
        pool.close()
    pool = WorkerPool(workers, slots)
    if owner is not None:
        _POOLS[owner] = pool
    return pool


class ProcessLoader(Generic[S, T]):
    """Items ``0 .. count-1`` loaded by ``job`` in ``workers`` processes, ``ahead`` in advance.

    Args:
        job: what each worker runs.
        count: number of items.
        ahead: items loaded in advance (at least ``workers``, so every worker is busy).
        workers: worker processes (>= 1).
        plan: for a two-phase job (``size`` and ``finish``), its argument chain.
        owner: whose pool to use and keep idle after a clean end (see :func:`pool_for`);
            None = a pool of this loader's own, stopped by :meth:`close`.
    """

    def __init__(
        self,
        job: Job[S, T],
        count: int,
        ahead: int,
        workers: int,
        plan: Plan | None = None,
        owner: Any = None,
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
        self._keep = owner is not None
        slots = -(-(self._ahead + 1) // workers) + 1
        self._pool: WorkerPool | None = pool_for(owner, workers, slots)
        try:
            self._pool.begin(job, plan is not None)
        except BaseException:  # KeyboardInterrupt included: nothing may stay half-sent
            self._pool.close()
            raise
        self._procs, self._conns, self._marks = self._pool.procs, self._pool.conns, self._pool.marks
        self._sent = -1  # the highest item sent to a worker
        self._taken = -1  # the highest item handed out
        self._failed = False
        self._done: dict[int, tuple[str, Any]] = {}  # received, not yet handed out
        self._sizes: dict[int, Any] = {}
        self._arg_at: tuple[int, Any] = (plan.first, plan.initial) if plan else (0, None)
        self._go_sent = -1  # the highest item sent its argument

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return self._pool.pids if self._pool is not None else []

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
        self._failed = True
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
        """Ends the iteration: an owner's pool with nothing in flight and no error stays
        idle for the next one; any other pool is stopped and its shared memory unlinked."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if self._keep and not (self._failed or self.pending()):
            pool.release()
        else:
            pool.close()

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
            return
        if kind == "ok":
            self._done[j] = ("ok", self._pool.reader.read(payload))
        else:
            self._done[j] = ("error", payload)

    def _died(self, i: int) -> ReaderWorkerError:
        """The error for worker ``i % N``, found dead while it owed item ``i``."""
        self._failed = True
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


def _shutdown(procs: list, conns: list[Connection], reader: SlotReader, prefix: str, pid: int) -> None:
    """Stops the workers (asks, then terminates, then kills) and unlinks their segments,
    with SIGINT held back so that a Ctrl-C cannot leave half of them behind."""
    if os.getpid() != pid:  # a forked copy of the owner: the workers are not its own
        return
    with sigint_deferred():
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
        unlink_prefix(prefix)
        reader.close()
