"""Running a config as N ranks on this host: what :func:`recaccel.launch` and
``recaccel-train --nproc N`` do.

The launcher checks the config and the run directory before any rank starts (hybrid
mode, data, a run already there, the world size of the checkpoint a resume reads),
holds the run directory's lock for every attempt of its ranks, writes the config the
ranks read, and starts them under torchrun's elastic agent
(:func:`~recaccel.train.distributed.launch.relaunch`). Each rank runs
``python -m recaccel.cli.rank``, which calls :func:`recaccel.train`; the ranks print as
the launching process does (its console lines: ``-v``, ``-q`` or neither). The metrics come back from the
run directory's metrics.json, which rank 0 writes last.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from recaccel.config import Config, config_to_toml
from recaccel.errors import ConfigError, RecaccelError
from recaccel.train.distributed import launch as agent

RANK_CONFIG = "config.toml"  # in the launcher's own temporary folder, read by every rank


def launch_ranks(
    cfg: Config, *, nproc: int, max_restarts: int = 0, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Trains ``cfg`` as ``nproc`` ranks on this host and returns rank 0's final metrics.

    Args:
        cfg: the run's config, its paths absolute (``parallel.mode`` must be ``hybrid``).
        nproc: number of ranks (processes; one per device).
        max_restarts: after a rank fails, restart every rank up to this many times,
            resuming from the newest checkpoint (0: the run fails).
        resume: continue the run in ``cfg.train.out_dir`` (on any number of ranks the
            checkpoint can move to).
        overwrite: replace a run already in ``cfg.train.out_dir``.

    Raises:
        ConfigError: bad ``nproc`` or ``max_restarts``, a config not in hybrid mode, both
            ``resume`` and ``overwrite``, called inside a torchrun rank.
        RecaccelError: a run directory in use or already holding a run, a checkpoint the
            ranks cannot resume, and :class:`~recaccel.train.distributed.launch.RankFailedError`
            when a rank failed (in the last attempt).
        Preempted: a signal stopped the ranks after their checkpoint was written.
        KeyboardInterrupt: a signal stopped the ranks before they could stop cleanly.
    """
    from recaccel.preflight import preflight

    check_arguments(cfg, nproc=nproc, max_restarts=max_restarts, resume=resume, overwrite=overwrite)
    preflight(cfg)  # bad fields, missing inputs: refused before any rank starts
    run_dir = Path(cfg.train.out_dir)
    clear = overwrite and max_restarts > 0
    with _run_dir_held(run_dir, cfg, nproc=nproc, resume=resume, overwrite=overwrite, clear=clear):
        with tempfile.TemporaryDirectory(prefix="recaccel-ranks-") as folder:
            argv = rank_argv(_write_rank_config(cfg, Path(folder)), resume=resume, overwrite=overwrite)
            ranks_until_stopped(run_dir, lambda: agent.relaunch(nproc, argv, max_restarts))
    return final_metrics(run_dir)


def check_arguments(cfg: Config, *, nproc: int, max_restarts: int, resume: bool, overwrite: bool) -> None:
    """The launch's own arguments, before anything is read or started.

    Raises:
        ConfigError: one line naming the bad argument.
    """
    agent.check_launch(cfg, nproc)
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if resume and overwrite:
        raise ConfigError("--resume continues the run in RUN_DIR; --overwrite would delete it: pass one")


@contextmanager
def _run_dir_held(
    run_dir: Path, cfg: Config, *, nproc: int, resume: bool, overwrite: bool, clear: bool
) -> Iterator[None]:
    """Holds ``run_dir``'s lock for the ``with`` block and lends it to the ranks (every
    attempt: a restarted rank 0 finds it held by its parent), after checking the run
    directory (:func:`check_run_dir_for_ranks`)."""
    from recaccel.train.run.run_lock import lend_to_ranks, locked

    with locked(run_dir), lend_to_ranks(run_dir):
        check_run_dir_for_ranks(run_dir, cfg, nproc=nproc, resume=resume, overwrite=overwrite, clear=clear)
        yield


def check_run_dir_for_ranks(
    run_dir: Path, cfg: Config, *, nproc: int, resume: bool, overwrite: bool, clear: bool
) -> None:
    """A resume: its newest checkpoint moves to ``nproc`` ranks. A new run: the directory
    holds no run unless ``overwrite``; with ``clear`` the old run is deleted now, not by
    rank 0 later (an elastic restart before that would resume the old run).

    Raises:
        RecaccelError: one line naming the directory or checkpoint and what is wrong.
    """
    from recaccel.train.distributed.dist_checkpoint import check_resume_world_size
    from recaccel.train.run.runlog import check_run_dir, clear_run

    if resume:
        check_resume_world_size(run_dir, cfg, nproc)
        return
    check_run_dir(run_dir, overwrite=overwrite)
    if clear:
        clear_run(run_dir)


def rank_argv(config_file: Path, *, resume: bool, overwrite: bool) -> list[str]:
    """The arguments of each rank's ``python -m recaccel.cli.rank``: the config file, the
    run's flags and this process's loudness (:func:`rank_loudness`)."""
    flags = ["--resume"] * resume + ["--overwrite"] * overwrite
    return [str(config_file), *flags, *rank_loudness()]


def rank_loudness() -> list[str]:
    """``--verbose`` or ``--quiet`` when this process shows its console lines so
    (:func:`~recaccel.train.run.console.show_console`: what ``-v`` and ``-q`` set), else none."""
    from recaccel.train.run.console import console

    level = console.level
    if level == logging.NOTSET:  # never set: the ranks' default
        return []
    return ["--verbose"] if level <= logging.DEBUG else ["--quiet"] if level > logging.CRITICAL else []


def _write_rank_config(cfg: Config, folder: Path) -> Path:
    path = folder / RANK_CONFIG
    path.write_text(config_to_toml(cfg))
    return path


def ranks_until_stopped(run_dir: Path, launch: Callable[[], int]) -> None:
    """Runs ``launch``; when a signal stopped its ranks cleanly (sent to the launcher,
    whose agent forwards it, or to a rank: they agree to stop; rank 0 printed where the
    run resumes), raises the :class:`~recaccel.train.loop.preemption.Preempted` rank 0 raised.

    Raises:
        Preempted: the ranks stopped cleanly (its ``exit_status``: 143 for SIGTERM, 130
            for SIGINT).
        KeyboardInterrupt, RankFailedError: the ranks ended before a clean stop.
    """
    from recaccel.train.loop.preemption import log_mark, stop_in_log

    start = log_mark(run_dir)  # this launch's events come after
    try:
        launch()
    except (KeyboardInterrupt, agent.RankFailedError):
        stopped = stop_in_log(run_dir, start)
        if stopped is None:
            raise
        raise stopped from None


def final_metrics(run_dir: Path) -> dict[str, Any]:
    """Rank 0's final metrics, from ``run_dir``'s metrics.json (non-finite values as None).

    Raises:
        RecaccelError: the ranks finished without writing it.
    """
    from recaccel.train.run.runlog import METRICS_FILE

    path = run_dir / METRICS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RecaccelError(f"{path}: the ranks finished but their metrics cannot be read ({e})") from None
