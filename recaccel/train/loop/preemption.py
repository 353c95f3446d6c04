"""Graceful stops: SIGTERM (what schedulers send on preemption) and SIGINT (Ctrl-C).

While :meth:`recaccel.train.loop.trainer.Trainer.fit` runs in the main thread,
:class:`StopSignals` replaces both signals' handlers with one that only records the
request. The loop finishes the step it is in, writes that step's checkpoint (the usual
atomic save), logs a ``stopped`` event, closes the run log and raises :class:`Preempted`;
``recaccel-train`` prints it on one line and exits 143 (SIGTERM) or 130 (SIGINT).

A second signal while stopping ends the process at once, killed by that signal (the
checkpoint being written is never visible half-written: it is renamed into place only when
complete). Under torchrun a repeat within :data:`REPEAT_WINDOW_S` of the first counts as the
same request: a scheduler that signals every process of a job reaches a rank both directly
and through torchrun's agent, which forwards the signal it gets.

In hybrid runs a rank never stops alone: :meth:`pending_signal` feeds the per-step
agreement (:meth:`recaccel.train.distributed.hybrid.HybridParallel.agree`), and every rank
stops after the same step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType

from recaccel.train.distributed.launch import under_torchrun
from recaccel.train.run.runlog import LOG_FILE

logger = logging.getLogger(__name__)

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run gracefully, in the order of the agreement's slots."""

REPEAT_WINDOW_S = 2.0
"""Under torchrun, a repeat this soon after the first signal is the same request."""

_active: StopSignals | None = None  # the guard of the fit running now


class Preempted(KeyboardInterrupt):
    """Training stopped on a signal after its checkpoint of step ``step`` was written.

    A :class:`KeyboardInterrupt` (not an ``Exception``): a stop request is not an error,
    ``except Exception`` blocks let it through, and code that handles Ctrl-C still does.

    Args:
        signal_name: ``"SIGTERM"`` or ``"SIGINT"``.
        step: the last step trained; the run's newest checkpoint is of this step.
        run_dir: the run directory (``--resume`` it to continue).
    """

    def __init__(self, signal_name: str, step: int, run_dir: str | Path) -> None:
        self.signal_name = signal_name
        self.step = step
        self.run_dir = str(run_dir)
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return (
            f"stopped by {self.signal_name} at step {self.step}; checkpoint saved "
            f"(resume with --resume {self.run_dir})"
        )

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, what a shell reports for a process it ended."""
        return 128 + int(signal.Signals[self.signal_name])

    def __str__(self) -> str:
        return self.message


def pending_signal() -> str | None:
    """The name of the stop signal this process got during the running fit (None: none)."""
    return _active.pending if _active is not None else None


class StopSignals:
    """Context manager: while active, SIGTERM and SIGINT request a stop instead of ending
    the process; the previous handlers come back on exit (also on error).

    Outside the main thread (where Python cannot install handlers) it does nothing.

    Attributes:
        pending: the first stop signal's name, or None.
    """

    def __init__(self) -> None:
        self.pending: str | None = None
        self._first_at = 0.0
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _active = self
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if _active is self:
            _active = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.pending is None:
            self.pending, self._first_at = name, time.monotonic()
            logger.warning("%s: stopping after the current step (send it again to exit at once)", name)
            return
        if under_torchrun() and time.monotonic() - self._first_at < REPEAT_WINDOW_S:
            return  # the same request, delivered twice (see the module docstring)
        # Die by the signal itself, as without this handler: no clean-up runs.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def log_mark(run_dir: Path) -> tuple[int, int]:
    """Where events appended to ``run_dir``'s log.jsonl from now on start: (the file's
    inode, its size); (0, 0) when there is no log yet."""
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        return 0, 0
    info = path.stat()
    return info.st_ino, info.st_size


def stop_in_log(run_dir: Path, mark: tuple[int, int]) -> Preempted | None:
    """The ``stopped`` event that rank 0 appended to ``run_dir``'s log.jsonl after ``mark``
    (:func:`log_mark`; all of a log made since, as by ``--overwrite``), as the
    :class:`Preempted` it raised (None when there is none: the ranks ended before they
    could stop cleanly)."""
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        return None
    inode, size = mark
    with open(path, "rb") as f:
        f.seek(size if os.fstat(f.fileno()).st_ino == inode else 0)
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if event.get("event") == "stopped":
            return Preempted(str(event["signal"]), int(event["step"]), run_dir)
    return None
