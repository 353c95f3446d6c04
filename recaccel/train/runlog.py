"""The run directory: resolved config, JSONL event log and final metrics."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from recaccel.config import Config, config_to_toml
from recaccel.errors import RecaccelError

CONFIG_FILE = "config.toml"
LOG_FILE = "log.jsonl"
METRICS_FILE = "metrics.json"
CHECKPOINT_DIR = "checkpoints"
RUN_FILES = (CONFIG_FILE, LOG_FILE, METRICS_FILE, CHECKPOINT_DIR)


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
    """Appends JSON events to ``run_dir/log.jsonl`` and writes the run's metrics."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.run_dir / LOG_FILE, "a", buffering=1)

    def write_config(self, cfg: Config) -> None:
        (self.run_dir / CONFIG_FILE).write_text(config_to_toml(cfg))

    def event(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "time": round(time.time(), 3), **fields}
        self._log.write(json.dumps(_finite(record)) + "\n")

    def write_metrics(self, metrics: dict[str, Any]) -> Path:
        path = self.run_dir / METRICS_FILE
        path.write_text(json.dumps(_finite(metrics), indent=2, sort_keys=True) + "\n")
        return path

    def close(self) -> None:
        self._log.close()


def _finite(value: Any) -> Any:
    """JSON has no NaN: write non-finite floats as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
