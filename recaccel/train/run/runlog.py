"""The run directory: resolved config, JSONL event log (and TensorBoard's, with
``train.loggers = ["jsonl", "tensorboard"]``) and final metrics."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recaccel.config import Config, config_to_toml
from recaccel.errors import ConfigError, RecaccelError
from recaccel.train.run.loggers import CSV_FILE, Logger, TensorBoardHParams, build_loggers, scalars

CONFIG_FILE = "config.toml"
LOG_FILE = "log.jsonl"
METRICS_FILE = "metrics.json"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
RUN_FILES = (CONFIG_FILE, LOG_FILE, METRICS_FILE, CSV_FILE, CHECKPOINT_DIR, TENSORBOARD_DIR)
_LOG_TMP = LOG_FILE + ".tmp"  # log.jsonl's rewrite on resume, renamed over it
# What recaccel writes, by folder: --overwrite deletes these names and nothing else.
_OWN_FILES = (CONFIG_FILE, LOG_FILE, _LOG_TMP, METRICS_FILE, CSV_FILE)
# eval-<step>.json and eval-<step>-<hash>.json of recaccel-eval, and their temporary files; the
# train.profile_steps trace and picture
_TOP_NAMES = re.compile(
    "^(" + "|".join(map(re.escape, _OWN_FILES)) + r"|eval-\d+(-[0-9a-f]{8})?\.json"
    r"|\.eval-\d+(-[0-9a-f]{8})?\.\d+\.tmp\.json"
    r"|profile-steps-\d+-\d+\.(json|png))$"
)
# step-<n>.pt and its sidecars and .tmp, step-<n>.dcp folders, their .step-<n>.dcp.partial;
# best.pt (train.best_metric), its digest file and their .tmp files
_CHECKPOINT_NAMES = re.compile(r"^(\.?step-\d+\..+|best\.(pt|tmp)(\.sha256)?(\.tmp)?)$")
_TENSORBOARD_NAMES = re.compile(r"^events\.out\.tfevents\..+$")
_RUN_FOLDERS = ((CHECKPOINT_DIR, _CHECKPOINT_NAMES), (TENSORBOARD_DIR, _TENSORBOARD_NAMES))


def run_files(run_dir: Path) -> list[str]:
    """The names of a run's files found in ``run_dir``: config, log, metrics, evaluations,
    and checkpoints/ or tensorboard/ when they hold files recaccel writes there."""
    run_dir = Path(run_dir)
    found = sorted(p.name for p in _owned(run_dir, _TOP_NAMES))
    found += [folder for folder, names in _RUN_FOLDERS if _owned(run_dir / folder, names)]
    return found


def check_run_dir(run_dir: Path, *, overwrite: bool) -> None:
    """Refuses to start a new run in a directory that holds another run's files (it would
    mix both: its log, checkpoints a later resume continues), unless ``overwrite``.

    Raises:
        RecaccelError: one line naming the directory and what it holds.
    """
    found = run_files(run_dir)
    if found and not overwrite:
        raise RecaccelError(
            f"run directory {run_dir} already holds a run ({', '.join(found)}); "
            "pass --overwrite (overwrite=True) to replace it or --resume to continue it"
        )


def clear_run(run_dir: Path) -> list[Path]:
    """Deletes what recaccel wrote into ``run_dir`` and nothing else, for ``--overwrite``.

    Deleted: config.toml, log.jsonl, metrics.json, ``eval-<step>.json``; in checkpoints/
    every ``step-<step>.*`` file or folder (checkpoints, their sidecars, ``.tmp`` files),
    ``.step-<step>.dcp.partial`` folders and ``best.pt`` with its sidecar; in tensorboard/ the ``events.out.tfevents.*``
    files. Those two folders go only when nothing else is left in them. The ``.lock``
    file stays (:mod:`recaccel.train.run.run_lock`): the caller holds it.

    Returns:
        The paths deleted.
    """
    run_dir = Path(run_dir)
    deleted = _owned(run_dir, _TOP_NAMES)
    for folder, names in _RUN_FOLDERS:
        deleted += _owned(run_dir / folder, names)
    for path in deleted:
        _delete(path)
    for folder, _ in _RUN_FOLDERS:
        _remove_if_empty(run_dir / folder)
    return deleted


def _owned(folder: Path, names: re.Pattern[str]) -> list[Path]:
    """The entries of ``folder`` whose names recaccel writes there (none when it is not a folder)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    return sorted(p for p in folder.iterdir() if names.match(p.name))


def _delete(path: Path) -> None:
    """Deletes a file, a link (not what it points to) or a folder."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _remove_if_empty(folder: Path) -> None:
    if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
        folder.rmdir()


class RunLog:
    """Appends JSON events to ``run_dir/log.jsonl`` and writes the run's metrics.

    Args:
        run_dir: the run directory.
        loggers: ``train.loggers``; log.jsonl is always written, ``"tensorboard"`` also
            writes each event's numbers as scalars under ``run_dir/tensorboard/`` (and the
            config as hyperparameters); ``"csv"``, ``"wandb"`` and ``"mlflow"`` are
            :mod:`recaccel.train.run.loggers`' loggers.
        resumed_at: the step a resumed run continues from: log.jsonl keeps only what
            was logged up to it (:func:`trim_log`), so each step appears once, and
            TensorBoard drops what an earlier writer logged after it. None: append to
            the log as it is (a torn last line is ended first).

    Raises:
        ConfigError: ``tensorboard``, ``wandb`` or ``mlflow`` without its package.
    """

    def __init__(
        self, run_dir: Path, *, loggers: Sequence[str] = ("jsonl",), resumed_at: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tensorboard = (
            TensorBoardLog(self.run_dir / TENSORBOARD_DIR, resumed_at or 0)
            if "tensorboard" in loggers
            else None
        )
        self._loggers: list[Logger] = build_loggers(self.run_dir, list(loggers), resumed_at)
        if self._tensorboard is not None:
            self._loggers.append(TensorBoardHParams(self._tensorboard.writer))
        path = self.run_dir / LOG_FILE
        if resumed_at is not None:
            trim_log(path, resumed_at)
        else:
            _end_last_line(path)
        self._log = open(path, "a", buffering=1)

    def write_config(self, cfg: Config) -> None:
        (self.run_dir / CONFIG_FILE).write_text(config_to_toml(cfg))
        for sink in self._loggers:
            sink.config(cfg)

    def event(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "time": round(time.time(), 3), **fields}
        self._log.write(json.dumps(_finite(record)) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.event(record)
        for sink in self._loggers:
            sink.event(record)

    def write_metrics(self, metrics: dict[str, Any]) -> Path:
        path = self.run_dir / METRICS_FILE
        path.write_text(json.dumps(_finite(metrics), indent=2, sort_keys=True) + "\n")
        return path

    def close(self) -> None:
        self._log.close()
        for sink in self._loggers:
            sink.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


class TensorBoardLog:
    """Each event's numbers as TensorBoard scalars, tagged ``<event>/<field>``
    (``train/loss``, ``train/lr``, ``eval/auc``, ``final/data/rows_read``, ...), at the
    event's step (a final event: at ``steps``).

    Args:
        log_dir: where the event files go.
        resumed_at: the step a resumed run continues from; > 0 makes TensorBoard drop
            the scalars an earlier writer logged at later steps.

    Raises:
        ConfigError: the tensorboard package is missing.
    """

    def __init__(self, log_dir: Path, resumed_at: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                f"train.loggers=tensorboard needs the tensorboard package (pip install tensorboard): {e}"
            ) from None
        self.writer = SummaryWriter(str(log_dir), purge_step=resumed_at + 1 if resumed_at > 0 else None)

    def event(self, record: dict[str, Any]) -> None:
        kind = record["event"]
        step = record.get("step", record.get("steps", 0))
        for name, value in scalars(record):
            self.writer.add_scalar(f"{kind}/{name}", value, global_step=step, walltime=record["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events of ``run_dir/log.jsonl``, in order (a line that does not parse, as the
    torn last line of a run killed while writing, is left out).

    Raises:
        FileNotFoundError: the run directory has no log.jsonl.
    """
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run log (is {run_dir} a run directory?)")
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def trim_log(path: Path, step: int) -> bool:
    """Rewrites the log ``path`` for a run resumed at ``step``, atomically, keeping what
    that run had logged by then.

    Kept: events at steps <= ``step`` (train, eval, monitor, straggler), and events
    without a step logged before the first event past ``step``. Dropped: events past
    ``step`` (their steps are trained again), step-less events after those (they belong
    to the abandoned stretch), every ``final`` event (the run goes on: it will write its
    own), and a torn line (a write cut short).

    Returns:
        True when the file was rewritten (False: nothing to drop, or no log yet).
    """
    path = Path(path)
    if not path.is_file():
        return False
    text = path.read_text()
    kept, past = [], False
    for line in text.splitlines():
        event = _parse(line)
        if event is None or event.get("event") == "final":
            continue
        at = event.get("step")
        if isinstance(at, int) and not isinstance(at, bool):
            past = past or at > step
            if at > step:
                continue
        elif past:
            continue
        kept.append(line + "\n")
    new = "".join(kept)
    if new == text:
        return False
    _replace(path, new)
    return True


def _parse(line: str) -> dict[str, Any] | None:
    """A log line's event; None for a torn or foreign line."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def _replace(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file renamed over it (a crash
    leaves the old file or the new one, never half of either)."""
    tmp = path.with_name(_LOG_TMP)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _end_last_line(path: Path) -> None:
    """Ends a torn last line of ``path`` with a newline, so the next event starts its own
    line (a reader skips the torn one)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def _finite(value: Any) -> Any:
    """JSON has no NaN: write non-finite floats as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
