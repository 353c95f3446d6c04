"""The run directory: resolved config, JSONL event log (and TensorBoard's, with
``train.loggers = ["jsonl", "tensorboard"]``) and final metrics."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from recaccel.config import Config, config_to_toml
from recaccel.errors import ConfigError, RecaccelError

CONFIG_FILE = "config.toml"
LOG_FILE = "log.jsonl"
METRICS_FILE = "metrics.json"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
RUN_FILES = (CONFIG_FILE, LOG_FILE, METRICS_FILE, CHECKPOINT_DIR, TENSORBOARD_DIR)
# Event fields that place a record rather than measure something.
_PLACE_FIELDS = frozenset({"event", "time", "step", "epoch"})


def run_files(run_dir: Path) -> list[str]:
    """The names of a run's files found in ``run_dir`` (config, log, metrics, checkpoints)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return [name for name in RUN_FILES if (run_dir / name).exists()]


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


def clear_run(run_dir: Path) -> None:
    """Deletes a previous run's files from ``run_dir`` (only those of :data:`RUN_FILES`)."""
    run_dir = Path(run_dir)
    for name in run_files(run_dir):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


class RunLog:
    """Appends JSON events to ``run_dir/log.jsonl`` and writes the run's metrics.

    Args:
        run_dir: the run directory.
        loggers: ``train.loggers``; log.jsonl is always written, ``"tensorboard"`` also
            writes each event's numbers as scalars under ``run_dir/tensorboard/``.
        resumed_at: the step a resumed run continues from (TensorBoard drops what an
            earlier writer logged after it).

    Raises:
        ConfigError: ``tensorboard`` without the tensorboard package.
    """

    def __init__(self, run_dir: Path, *, loggers: Sequence[str] = ("jsonl",), resumed_at: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tensorboard = (
            TensorBoardLog(self.run_dir / TENSORBOARD_DIR, resumed_at) if "tensorboard" in loggers else None
        )
        self._log = open(self.run_dir / LOG_FILE, "a", buffering=1)

    def write_config(self, cfg: Config) -> None:
        (self.run_dir / CONFIG_FILE).write_text(config_to_toml(cfg))

    def event(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "time": round(time.time(), 3), **fields}
        self._log.write(json.dumps(_finite(record)) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.event(record)

    def write_metrics(self, metrics: dict[str, Any]) -> Path:
        path = self.run_dir / METRICS_FILE
        path.write_text(json.dumps(_finite(metrics), indent=2, sort_keys=True) + "\n")
        return path

    def close(self) -> None:
        self._log.close()
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


def scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The finite numbers of an event (nested dicts as ``a/b``), without the fields that
    place it (event, time, step, epoch)."""
    for key, value in record.items():
        if not prefix and key in _PLACE_FIELDS:
            continue
        if isinstance(value, dict):
            yield from scalars(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            yield f"{prefix}{key}", float(value)


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


def _finite(value: Any) -> Any:
    """JSON has no NaN: write non-finite floats as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
