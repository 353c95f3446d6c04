"""The run's optional loggers (``train.loggers``) beside log.jsonl: a CSV file, Weights &
Biases and MLflow, and TensorBoard's hyperparameters.

Each logger gets the resolved config once (:meth:`config`) and every event of the run
log (:meth:`event`): a record with ``event``, ``time``, usually ``step`` and numbers.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from recaccel.config import Config, config_to_dict, config_to_toml
from recaccel.errors import ConfigError

CSV_FILE = "metrics.csv"
# metrics.csv's header: one row per log step (a ``train`` event); a missing value is empty.
CSV_COLUMNS = (
    "step",
    "epoch",
    "time",
    "loss",
    "lr",
    "sparse_lr",
    "samples_per_s",
    "data_wait_s",
    "grad_norm",
    "window_auc",
    "window_logloss",
    "window_rows",
)
# Event fields that place a record rather than measure something.
_PLACE_FIELDS = frozenset({"event", "time", "step", "epoch"})
# The metrics TensorBoard's hparams table shows beside each run's hyperparameters.
HPARAM_METRICS = (
    "final/auc",
    "final/logloss",
    "final/ne",
    "final/mae",
    "final/rmse",
    "eval/auc",
    "eval/logloss",
)


class Logger(Protocol):
    """What RunLog hands the config and each event to."""

    def config(self, cfg: Config) -> None: ...

    def event(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def flat_config(cfg: Config) -> dict[str, Any]:
    """The config as ``section.key`` -> a number, string or bool (lists and tables as JSON)."""
    out: dict[str, Any] = {}
    for section, values in config_to_dict(cfg).items():
        for key, value in values.items():
            plain = isinstance(value, bool | int | float | str)
            out[f"{section}.{key}"] = value if plain else json.dumps(value, sort_keys=True, default=str)
    return out


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


def event_numbers(record: dict[str, Any]) -> dict[str, float]:
    """``<event>/<field>`` -> value for every finite number of an event (as TensorBoard's tags)."""
    return {f"{record['event']}/{name}": value for name, value in scalars(record)}


def record_step(record: dict[str, Any]) -> int:
    """The step an event belongs to (a final event: its ``steps``)."""
    return int(record.get("step", record.get("steps", 0)))


def import_for(logger: str, package: str) -> Any:
    """Imports ``package`` for ``train.loggers``' ``logger``.

    Raises:
        ConfigError: one line naming the missing package.
    """
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(
            f"config key train.loggers has {logger!r} but the {package} package is not installed "
            f"(pip install {package}), or leave {logger!r} out"
        ) from None


class CsvLog:
    """metrics.csv in the run directory: one row per log step, the columns of
    :data:`CSV_COLUMNS` (a stable header whatever the run logs).

    Args:
        path: the CSV file.
        resumed_at: the step a resumed run continues from: rows past it are dropped (those
            steps are trained again). None: a new file.
    """

    def __init__(self, path: Path, resumed_at: int | None = None) -> None:
        kept = _rows_up_to(path, resumed_at) if resumed_at is not None else []
        self._file = open(path, "w", newline="", buffering=1)
        self._writer = csv.DictWriter(self._file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        self._writer.writeheader()
        self._writer.writerows(kept)

    def config(self, cfg: Config) -> None:
        pass

    def event(self, record: dict[str, Any]) -> None:
        if record["event"] == "train":
            self._writer.writerow({k: _cell(v) for k, v in record.items()})

    def close(self) -> None:
        self._file.close()


def _cell(value: Any) -> Any:
    """A CSV cell: NaN and None are empty."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return value


def _rows_up_to(path: Path, step: int) -> list[dict[str, str]]:
    """The rows of an earlier metrics.csv at steps <= ``step`` (none if there is no file)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [
            row for row in csv.DictReader(f) if row.get("step", "").isdigit() and int(row["step"]) <= step
        ]


class TensorBoardHParams:
    """The config in TensorBoard: every key as a hyperparameter (the HParams dashboard,
    next to :data:`HPARAM_METRICS`) and the whole config.toml as text.

    Args:
        writer: the run's ``SummaryWriter``.
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def config(self, cfg: Config) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(flat_config(cfg), dict.fromkeys(HPARAM_METRICS, 0.0)):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```toml\n" + config_to_toml(cfg) + "```")
        self.writer.flush()

    def event(self, record: dict[str, Any]) -> None:
        pass  # the scalars are TensorBoardLog's

    def close(self) -> None:
        pass  # the writer is TensorBoardLog's


class _NumbersLog(ABC):
    """A logger of each event's finite numbers at the event's step (nothing for an event
    without any); subclasses say how one event's numbers are sent."""

    def event(self, record: dict[str, Any]) -> None:
        numbers = event_numbers(record)
        if numbers:
            self._log_numbers(numbers, record_step(record))

    @abstractmethod
    def _log_numbers(self, numbers: dict[str, float], step: int) -> None:
        """Sends one event's numbers at ``step``."""


class WandbLog(_NumbersLog):
    """Weights & Biases: the config, and each event's numbers at its step.

    Args:
        run_dir: the run directory (W&B writes its own files under it).
        resumed_at: the step a resumed run continues from, or None.

    Raises:
        ConfigError: the wandb package is not installed.
    """

    def __init__(self, run_dir: Path, resumed_at: int | None = None) -> None:
        self._wandb = import_for("wandb", "wandb")
        self._run = self._wandb.init(dir=str(run_dir), name=run_dir.name, resume="allow")

    def config(self, cfg: Config) -> None:
        self._run.config.update(flat_config(cfg), allow_val_change=True)

    def _log_numbers(self, numbers: dict[str, float], step: int) -> None:
        self._run.log(numbers, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowLog(_NumbersLog):
    """MLflow: the config as parameters, and each event's numbers as metrics at its step.

    Args:
        run_dir: the run directory (its name is the MLflow run's).
        resumed_at: the step a resumed run continues from, or None.

    Raises:
        ConfigError: the mlflow package is not installed.
    """

    def __init__(self, run_dir: Path, resumed_at: int | None = None) -> None:
        self._mlflow = import_for("mlflow", "mlflow")
        self._run = self._mlflow.start_run(run_name=run_dir.name)

    def config(self, cfg: Config) -> None:
        for chunk in _chunks(flat_config(cfg), 100):  # MLflow takes at most 100 per call
            self._mlflow.log_params(chunk)

    def _log_numbers(self, numbers: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _chunks(values: dict[str, Any], size: int) -> Iterator[dict[str, Any]]:
    items = list(values.items())
    for start in range(0, len(items), size):
        yield dict(items[start : start + size])


def build_loggers(run_dir: Path, names: list[str] | tuple[str, ...], resumed_at: int | None) -> list[Logger]:
    """The loggers ``train.loggers`` names beyond jsonl and tensorboard (RunLog's own).

    Raises:
        ConfigError: wandb or mlflow named but not installed.
    """
    makers = {
        "csv": lambda: CsvLog(run_dir / CSV_FILE, resumed_at),
        "wandb": lambda: WandbLog(run_dir, resumed_at),
        "mlflow": lambda: MlflowLog(run_dir, resumed_at),
    }
    # wandb and mlflow first: a missing package fails before any file is opened
    order = sorted((name for name in names if name in makers), key=lambda name: name == "csv")
    return [makers[name]() for name in order]
