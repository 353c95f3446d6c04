"""Launching hybrid runs: :func:`recaccel.launch` (``recaccel-train --nproc N``) runs N
torchrun ranks on this host.

``recaccel.launch(cfg, nproc=2)`` (or ``recaccel-train --nproc 2 --config c.toml --set
parallel.mode=hybrid``) starts torchrun's elastic agent
(:func:`torch.distributed.launcher.api.elastic_launch`, what ``torchrun --standalone
--nproc-per-node 2`` runs) inside this process (see
:mod:`recaccel.train.distributed.launcher` for the checks before). The agent starts two
workers on this host, each running ``python -m recaccel.cli.rank`` on the config the
launcher wrote (:data:`RANK_MODULE`), and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and the rendezvous address; :class:`~recaccel.train.distributed.hybrid.HybridParallel`
joins the process group from them.

Several hosts: run torchrun yourself on each (``--nnodes``, ``--rdzv-endpoint``), e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500
-m recaccel.cli --config c.toml``.

Failure. When a rank fails, the agent stops the others (SIGTERM, SIGKILL after
:data:`SHUTDOWN_TIMEOUT_S`) and ``recaccel-train`` exits 2 with one line about the rank
that failed first (:func:`recaccel.launch` raises :class:`RankFailedError` with it):
its own message when it ended with a :class:`~recaccel.errors.RecaccelError` (a rank hands that line to the agent through
torchrun's error file instead of printing it, see :func:`report_rank_error`), else how
it ended (``rank 1 failed first: killed by SIGKILL (pid 1234)``). The agent's timestamps
have a resolution of one second, so "first" is decided by, in order: a
:class:`~recaccel.train.distributed.hybrid.CollectiveError` (a rank that lost a peer) comes after any
other failure; the earlier timestamp; the order in which the agent saw the failures (it
records the ranks it stopped itself after the failures that made it stop). The agent's
own log lines and its traceback block are not shown; the ranks' output passes through.

Elastic restarts. ``recaccel-train --nproc N --max-restarts K`` (``max_restarts=K``) lets the agent restart
every rank up to K times after a failure (torchrun's ``--max-restarts``) instead of
ending the run: the new workers see ``TORCHELASTIC_RESTART_COUNT`` > 0
(:func:`restart_count`) and resume from the newest checkpoint of the run directory
(from step 0 when none was written yet), whatever the command line said: a restart is
never a new run, so ``--overwrite`` deletes nothing then (with ``--max-restarts`` the
launcher itself clears the old run before any rank starts). Only when the K restarts
are spent does the run fail as above. The restarted rank 0 records each restart: a
``restart`` event in log.jsonl, one console line, and the count in metrics.json's
``restarts`` (see the trainer). Each attempt's rank 0 then hosts the process
group's store (the agent's shared store would hand the restarted ranks the previous
attempt's keys, pytorch/pytorch#135712); under your own ``torchrun --max-restarts`` set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the same reason. A run may also continue
on another number of ranks, ``recaccel-train --resume RUN_DIR --nproc M`` (see
:mod:`recaccel.train.distributed.dist_checkpoint` for what moves and what is refused).

Only rank 0 writes the run directory's config.toml, log.jsonl and metrics.json and
shows a progress bar; every rank writes its shards of each checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from recaccel.config import Config
from recaccel.errors import ConfigError, RecaccelError
from recaccel.train.distributed.collectives import CollectiveError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.launcher.api import LaunchConfig

SHUTDOWN_TIMEOUT_S = 10
"""Seconds the agent waits for the surviving ranks to leave after SIGTERM before SIGKILL."""

MONITOR_INTERVAL_S = 0.1
"""How often the agent polls its ranks (torchrun's default)."""

_REPORT_KEY = "recaccel"  # our entry in torchrun's per-rank error file
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # the agent installs handlers for these
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # read by the agent's c10d rendezvous


RANK_MODULE = "recaccel.cli.rank"
"""What each rank of :func:`recaccel.launch` runs: it reads the launcher's config file and
calls :func:`recaccel.train`."""


class RankFailedError(RecaccelError):
    """A rank of a ``--nproc`` run failed; the message names the one that failed first."""


def under_torchrun() -> bool:
    """True in a process torchrun (or another launcher) started as one of several ranks."""
    return os.environ.get("RANK") is not None and os.environ.get("WORLD_SIZE") is not None


def restart_count() -> int:
    """How many times torchrun's agent has restarted this rank's workers (0: the first
    attempt, or not under an elastic agent)."""
    try:
        return max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), 0)
    except ValueError:
        return 0


def check_launch(cfg: Config, nproc: int) -> None:
    """Checks before launching ``nproc`` ranks that the config trains in hybrid mode.

    Raises:
        ConfigError: ``nproc`` < 1, or ``parallel.mode`` is not ``hybrid``.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if cfg.parallel.mode != "hybrid":
        raise ConfigError(
            f"--nproc {nproc} runs one process per rank, which needs parallel.mode=hybrid "
            f"(got {cfg.parallel.mode!r}); add --set parallel.mode=hybrid"
        )


def launch_config(nproc: int, log_dir: str, max_restarts: int = 0) -> LaunchConfig:
    """The agent's settings for ``nproc`` ranks on this host (``torchrun --standalone``).

    Args:
        nproc: number of ranks.
        log_dir: where the agent keeps the ranks' error files.
        max_restarts: how many times the agent restarts every rank after a failure
            (0: a failed rank ends the run; ``--resume`` continues it).

    Raises:
        ConfigError: ``nproc`` < 1 or ``max_restarts`` < 0.
    """
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=MONITOR_INTERVAL_S,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


def relaunch(nproc: int, argv: Sequence[str], max_restarts: int = 0, module: str = RANK_MODULE) -> int:
    """Runs ``python -m module *argv`` as ``nproc`` ranks under torchrun's agent and waits.

    Args:
        nproc: number of processes (one per device).
        argv: each rank's command-line arguments.
        max_restarts: restarts of every rank after a failure before the run fails (the
            restarted ranks resume from the newest checkpoint).

    Returns:
        0: every rank finished.

    Raises:
        ConfigError: already running under torchrun (a rank must not launch more ranks).
        RankFailedError: a rank failed (in the last attempt; see the module docstring for
            which one is named).
        KeyboardInterrupt: this process got SIGINT, SIGTERM, SIGHUP or SIGQUIT; the ranks
            were stopped.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if under_torchrun():
        raise ConfigError("--nproc given inside a torchrun worker; drop --nproc when launching with torchrun")
    with tempfile.TemporaryDirectory(prefix="recaccel-launch-") as log_dir, _agent_scope(nproc, max_restarts):
        config = launch_config(nproc, log_dir, max_restarts)
        try:
            elastic_launch(config, sys.executable)("-u", "-m", module, *argv)
        except ChildFailedError as e:
            raise rank_failure(e.failures) from None
        except SignalException:
            raise KeyboardInterrupt from None
    return 0


@contextmanager
def _agent_scope(nproc: int, max_restarts: int = 0) -> Iterator[None]:
    """Runs the agent in this process and puts back what it changes: its signal handlers,
    environment variables and (silenced) loggers."""
    env_keys = ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE", _NO_SHARED_STORE)
    saved_env = {key: os.environ.get(key) for key in env_keys}
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        signals = [getattr(signal, name) for name in _AGENT_SIGNALS if hasattr(signal, name)]
        handlers = {sig: signal.getsignal(sig) for sig in signals}
    loggers = {name: logging.getLogger(name) for name in _AGENT_LOGGERS}
    saved_loggers = {name: (lg.propagate, list(lg.handlers)) for name, lg in loggers.items()}
    # One intra-op thread pool per rank would oversubscribe the host's cores (the ranks
    # inherit this process's environment).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts > 0:
        # The agent's shared store outlives an attempt, and the restarted ranks' process
        # group would read the previous attempt's keys there (gloo: the dead ranks'
        # addresses, a hang; pytorch/pytorch#135712): each attempt's rank 0 hosts its own.
        os.environ[_NO_SHARED_STORE] = "1"
    for lg in loggers.values():  # the failure is reported in one line instead
        lg.propagate, lg.handlers = False, [logging.NullHandler()]
    try:
        yield
    finally:
        for name, (propagate, kept) in saved_loggers.items():
            loggers[name].propagate, loggers[name].handlers = propagate, kept
        for sig, handler in handlers.items():
            if handler is not None:  # None: installed outside Python, cannot be put back
                signal.signal(sig, handler)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rank_report(failure: ProcessFailure) -> dict[str, Any]:
    """What a rank wrote with :func:`report_rank_error` (empty when it wrote nothing)."""
    data = failure.error_file_data
    report = data.get(_REPORT_KEY) if isinstance(data, dict) else None
    return report if isinstance(report, dict) else {}


def first_failure(failures: Mapping[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The rank that failed first, and its failure.

    Args:
        failures: the agent's failures by global rank, in the order it recorded them
            (``ChildFailedError.failures``); not empty.

    Returns:
        ``(rank, failure)``: not a lost peer if any other failure is there, then the
        earliest timestamp, then the first recorded.
    """

    def order(item: tuple[int, tuple[int, ProcessFailure]]) -> tuple[bool, int, int]:
        seen, (_, failure) = item
        return bool(_rank_report(failure).get("peer_failure")), failure.timestamp, seen

    _, (rank, failure) = min(enumerate(failures.items()), key=order)
    return rank, failure


def rank_failure(failures: Mapping[int, ProcessFailure]) -> RankFailedError:
    """The one-line error for a run whose ranks failed (see :func:`first_failure`).

    Args:
        failures: the agent's failures by global rank, in the order it recorded them.
    """
    rank, failure = first_failure(failures)
    message = _rank_report(failure).get("message")
    if isinstance(message, str) and message:
        return RankFailedError(message)
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
    return RankFailedError(f"rank {rank} failed first: {how} (pid {failure.pid})")


def report_rank_error(error: BaseException) -> bool:
    """In a rank started by torchrun's agent, hands ``error``'s one-line message to the agent.

    The message goes into the error file the agent named (``TORCHELASTIC_ERROR_FILE``), in
    torchrun's format, so ``recaccel-train --nproc`` shows it once (and a ``torchrun`` run
    shows it as its root cause) instead of every rank printing its own line.

    Args:
        error: what ends the rank (its ``str`` is the message).

    Returns:
        True when the message was handed over (the rank prints nothing); False outside a
        torchrun agent's rank.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (path and under_torchrun()):
        return False
    text = str(error)
    data = {
        "message": {
            "message": f"{type(error).__name__}: {text}",
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
        },
        _REPORT_KEY: {"message": text, "peer_failure": _is_peer_failure(error)},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data))
    return True


def _is_peer_failure(error: BaseException) -> bool:
    return isinstance(error, CollectiveError)


def exit_rank(code: int) -> NoReturn:
    """Ends a torchrun rank process with exit status ``code``, skipping interpreter teardown.

    When a rank returns, its results are on disk (checkpoint shards, and on rank 0 the
    closed log and metrics.json). Tearing the interpreter down after a gloo process group
    and Arrow's thread pool have run can abort intermittently ("terminate called without
    an active exception", exit -6): native worker threads re-enter the finalizing
    interpreter or are destroyed while joinable (pytorch/pytorch#179291,
    apache/arrow#34314 and #39862). torchrun would then report the finished run as failed,
    so a rank flushes its streams and logs and leaves with ``os._exit``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


_LAUNCHER_OPTIONS = ("--nproc", "--max-restarts")  # the launcher's own: not forwarded to ranks


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without its launcher options: ``--nproc N`` / ``--nproc=N`` and
    ``--max-restarts K`` / ``--max-restarts=K``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _LAUNCHER_OPTIONS:
            skip = True
            continue
        if arg.startswith(tuple(f"{option}=" for option in _LAUNCHER_OPTIONS)):
            continue
        out.append(arg)
    return out
