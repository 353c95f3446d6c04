"""The best periodic evaluation of a run (``train.best_metric``) and early stopping.

Every periodic evaluation (``train.eval_every``) is compared with the best so far: a
better value becomes the best (the trainer keeps that step's checkpoint as
``checkpoints/best.pt``); otherwise the count of evaluations since the best grows, and at
``train.early_stop_patience`` the run stops early. The record travels in every checkpoint
(:class:`~recaccel.train.checkpoint.state.BestRecord`), so a resumed run decides as an
uninterrupted one would.
"""

from __future__ import annotations

import math
import re
from typing import Any

from recaccel.config import TrainConfig
from recaccel.errors import ConfigError
from recaccel.train.checkpoint.state import BestRecord

# Metric names (or parts of names, split at non-letters) where smaller is better.
_LOWER_IS_BETTER = frozenset({"ne", "mae", "mse", "rmse"})


def lower_is_better(metric: str, mode: str) -> bool:
    """Whether a smaller ``metric`` is better: ``mode`` min or max, or auto (min for names
    containing "loss" or with a part ne, mae, mse or rmse, e.g. ``logloss``, ``query_ne``)."""
    if mode != "auto":
        return mode == "min"
    name = metric.lower()
    return "loss" in name or any(part in _LOWER_IS_BETTER for part in re.split(r"[^a-z]+", name))


def metric_value(metrics: dict[str, Any], metric: str) -> float:
    """``metrics[metric]`` as a float.

    Raises:
        ConfigError: one line naming train.best_metric and the metrics an evaluation reports.
    """
    value = metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        names = ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, float)))
        raise ConfigError(
            f"config key train.best_metric={metric!r} is not an evaluation metric; it reports {names}"
        )
    return float(value)


def improves(record: BestRecord | None, value: float, lower: bool) -> bool:
    """Whether ``value`` beats the best so far (a NaN never does; anything beats none)."""
    if math.isnan(value):
        return False
    if record is None or math.isnan(record.value):
        return True
    return value < record.value if lower else value > record.value


def next_record(
    record: BestRecord | None, metrics: dict[str, Any], train: TrainConfig, step: int
) -> BestRecord:
    """The record after the evaluation at ``step``: the new best, or one more evaluation
    since it (and ``stopped_at`` = ``step`` once that count reaches the patience)."""
    value = metric_value(metrics, train.best_metric)
    if improves(record, value, lower_is_better(train.best_metric, train.best_mode)):
        return BestRecord(value=value, step=step)
    if record is None:  # NaN at the first evaluation: nothing is best yet
        record = BestRecord(value=math.nan, step=step)
    waited = record.evals_since + 1
    patience = train.early_stop_patience
    stopped = step if patience > 0 and waited >= patience else None
    return BestRecord(value=record.value, step=record.step, evals_since=waited, stopped_at=stopped)


def summary(record: BestRecord | None, train: TrainConfig) -> dict[str, Any]:
    """metrics.json's ``best`` (and ``early_stop`` with a patience) entries."""
    if not train.best_metric:
        return {}
    best = None if record is None or math.isnan(record.value) else record
    out: dict[str, Any] = {
        "best": {
            "metric": train.best_metric,
            "value": best.value if best else None,
            "step": best.step if best else None,
        }
    }
    if train.early_stop_patience > 0:
        stopped_at = record.stopped_at if record is not None else None
        out["early_stop"] = {
            "stopped": stopped_at is not None,
            "step": stopped_at,
            "patience": train.early_stop_patience,
        }
    return out
