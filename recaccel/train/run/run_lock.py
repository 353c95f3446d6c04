"""One process per run directory: training holds an exclusive lock on ``RUN/.lock``.

``recaccel-train`` (and :func:`recaccel.api.train` / :func:`recaccel.api.resume`) takes
``flock(LOCK_EX | LOCK_NB)`` on ``RUN/.lock`` before anything in the run directory is
written or deleted (``--overwrite`` included) and keeps it until the run ends. A second
train or resume of the same directory is refused in one line naming the holder (pid,
host, start time, written into the lock file). The lock belongs to the open file, so the
operating system drops it when the holder dies, even by SIGKILL: a lock file left behind
never blocks (a process the holder forks closes its copy, so it cannot keep the lock alive
after its parent died). The file itself is never deleted (deleting it while another process waits
on it would let two processes lock two different files).

Hybrid runs: only rank 0 locks. Under ``recaccel-train --nproc`` the launcher holds the
lock for every attempt of its ranks (elastic restarts included) and tells them so through
the environment (:func:`lend_to_ranks`); its rank 0 then takes nothing.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from recaccel.errors import RecaccelError

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
RESTART_WAIT_S = 30.0
"""How long a restarted rank 0 waits for the previous attempt's rank 0 to let go."""

_DIR_ENV = "RECACCEL_RUN_LOCK_DIR"  # set by a launcher holding the lock for its ranks
_PID_ENV = "RECACCEL_RUN_LOCK_PID"
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
_POLL_S = 0.2


class RunDirInUseError(RecaccelError):
    """Another process trains in the run directory."""


_held: dict[str, list[int]] = {}  # real path -> [fd, holds]: re-entrant within a process


def _drop_inherited() -> None:
    """In a forked child: closes the lock files it inherited. The parent keeps its lock,
    and a child that outlives a killed parent (a compile worker) does not keep it."""
    for fd, _ in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_drop_inherited)


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def acquire(run_dir: Path, *, wait_s: float = 0.0) -> None:
    """Locks ``run_dir`` for this process (creating it and its lock file), or counts one
    more hold when this process already has it.

    Args:
        run_dir: the run directory.
        wait_s: how long to retry while another process holds it (0: refuse at once).

    Raises:
        RunDirInUseError: another process holds the lock.
        RecaccelError: the lock file cannot be created.
    """
    key = _key(run_dir)
    if key in _held:
        _held[key][1] += 1
        return
    fd = _open_lock_file(Path(run_dir))
    try:
        _lock(fd, Path(run_dir), wait_s)
        _write_holder(fd)
    except BaseException:
        os.close(fd)
        raise
    _held[key] = [fd, 1]


def release(run_dir: Path) -> None:
    """Drops one hold of :func:`acquire`; the last closes the file, which unlocks it."""
    key = _key(run_dir)
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        os.close(entry[0])


def holds(run_dir: Path) -> bool:
    """True when this process holds the lock of ``run_dir``."""
    return _key(run_dir) in _held


@contextmanager
def locked(run_dir: Path, *, wait_s: float = 0.0) -> Iterator[None]:
    """Holds the lock of ``run_dir`` for the ``with`` block (see :func:`acquire`)."""
    acquire(run_dir, wait_s=wait_s)
    try:
        yield
    finally:
        release(run_dir)


@contextmanager
def for_training(run_dir: Path) -> Iterator[None]:
    """The lock a training process needs on ``run_dir``, held for the ``with`` block.

    One process: locks. A torchrun rank other than 0: nothing (rank 0 locks for the run).
    Rank 0 started by a ``--nproc`` launcher that holds the lock: nothing. Rank 0 of an
    attempt restarted by torchrun's agent waits up to :data:`RESTART_WAIT_S` for the
    previous attempt's rank 0 to exit.
    """
    rank = os.environ.get("RANK")
    if rank not in (None, "0") or lent_by_parent(run_dir):
        yield
        return
    restarted = (os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0") != "0"
    with locked(run_dir, wait_s=RESTART_WAIT_S if restarted else 0.0):
        yield


@contextmanager
def lend_to_ranks(run_dir: Path) -> Iterator[None]:
    """While the ``with`` block runs, the processes this one starts (a launcher's ranks)
    know that their parent holds the lock of ``run_dir`` (:func:`lent_by_parent`).

    Raises:
        RecaccelError: this process does not hold the lock.
    """
    if not holds(run_dir):
        raise RecaccelError(f"run directory {run_dir} is not locked by this process; lock it first")
    saved = {name: os.environ.get(name) for name in (_DIR_ENV, _PID_ENV)}
    os.environ[_DIR_ENV], os.environ[_PID_ENV] = _key(run_dir), str(os.getpid())
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def lent_by_parent(run_dir: Path) -> bool:
    """True when this process's parent holds the lock of ``run_dir`` for it
    (:func:`lend_to_ranks`): the pid check ignores variables inherited from further up."""
    return os.environ.get(_DIR_ENV) == _key(run_dir) and os.environ.get(_PID_ENV) == str(os.getppid())


def _open_lock_file(run_dir: Path) -> int:
    """Opens (creating) ``run_dir/.lock`` without truncating it: a holder's details stay
    readable to the process that is refused."""
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise RecaccelError(f"cannot create the run lock {path}: {e.strerror or e}") from None


def _lock(fd: int, run_dir: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in _BUSY:  # a file system without flock: train unguarded
                logger.warning("cannot lock %s (%s): nothing keeps a second run out", run_dir / LOCK_FILE, e)
                return
        if time.monotonic() >= deadline:
            raise RunDirInUseError(
                f"run directory {run_dir} is in use by {holder(run_dir)}; "
                "wait for it or use another train.out_dir"
            )
        time.sleep(_POLL_S)


def _write_holder(fd: int) -> None:
    """Writes who holds the lock into the (locked) file, replacing a previous holder's."""
    since = time.strftime("%Y-%m-%d %H:%M:%S %z")
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def holder(run_dir: Path) -> str:
    """Who holds (or last held) the lock of ``run_dir``, as the refusal names it:
    ``process 123 (on host h, since 2026-01-02 10:00:00 +0000)``."""
    try:
        info = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        return f"process {int(info['pid'])} (on host {info['host']}, since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):  # the holder has not written it yet
        return "another process"
