"""train.run.loggers: wandb and MLflow get each event's finite numbers at the event's step.

The packages are stood in for by small recorders put in ``sys.modules`` (they are not
installed here); what is checked is what recaccel hands them."""

from __future__ import annotations

import sys
import types

import pytest

from recaccel.train.run.loggers import MlflowLog, WandbLog

EVENTS = [
    {"event": "train", "step": 3, "loss": 0.5, "note": "text", "rates": {"lr": 0.01}},
    {"event": "eval", "step": 3, "name": "valid"},  # no numbers: nothing sent
    {"event": "final", "steps": 7, "auc": 0.75, "bad": float("nan")},
]
EXPECTED = [
    ({"train/loss": 0.5, "train/rates/lr": 0.01}, 3),
    ({"final/steps": 7.0, "final/auc": 0.75}, 7),
]


def _wandb(sent: list) -> types.ModuleType:
    run = types.SimpleNamespace(log=lambda numbers, step: sent.append((numbers, step)))
    return types.SimpleNamespace(init=lambda **kwargs: run)


def _mlflow(sent: list) -> types.ModuleType:
    return types.SimpleNamespace(
        start_run=lambda **kwargs: None,
        log_metrics=lambda numbers, step: sent.append((numbers, step)),
    )


@pytest.mark.parametrize(
    ("name", "logger", "package"), [("wandb", WandbLog, _wandb), ("mlflow", MlflowLog, _mlflow)]
)
def test_wandb_and_mlflow_get_each_events_numbers_at_its_step(name, logger, package, tmp_path, monkeypatch):
    sent: list = []
    monkeypatch.setitem(sys.modules, name, package(sent))
    log = logger(tmp_path / "run")
    for record in EVENTS:
        log.event(record)
    assert sent == EXPECTED
