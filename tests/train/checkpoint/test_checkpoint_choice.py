"""Checkpoints one chooses: how many step checkpoints stay, best.pt by an evaluation metric,
early stopping, and their exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from recaccel.cli import train_main
from recaccel.errors import RecaccelError
from recaccel.train.checkpoint.best import lower_is_better
from recaccel.train.checkpoint.digests import verify_file
from recaccel.train.checkpoint.state import BestRecord, list_checkpoints
from recaccel.train.run.runlog import clear_run
from tests.helpers.resume import STEPS_PER_EPOCH, assert_same_entries, assert_same_run, small_sets

pytestmark = pytest.mark.numeric

EVERY = 2  # a periodic evaluation every 2 steps
# min on auc: training raises the AUC, so the first evaluations are "best" and the run stops early
EARLY = ("train.eval_every=2", "train.best_metric=auc", "train.best_mode=min", "train.early_stop_patience=2")


def _events(run: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run / "log.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _expected(evals: list[dict[str, Any]], lower: bool, patience: int) -> tuple[int, float, int | None]:
    """(best step, best value, early-stop step) the rule gives for the logged evaluations."""
    best_step, best, waited = -1, math.nan, 0
    for e in evals:
        value = e["auc"]
        if math.isnan(best) or (value < best if lower else value > best):
            best_step, best, waited = e["step"], value, 0
            continue
        waited += 1
        if patience and waited >= patience:
            return best_step, best, e["step"]
    return best_step, best, None


def test_keep_checkpoints_3_keeps_the_three_newest(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    sets = small_sets(
        small_data, run, "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.steps=10"
    )
    assert train_main(sets) == 0
    assert [p.name for p in list_checkpoints(run)] == [f"step-{s:09d}.pt" for s in (6, 8, 10)]
    sidecars = sorted(p.name for p in (run / "checkpoints").glob("step-*.pt.sha256"))
    assert sidecars == [f"step-{s:09d}.pt.sha256" for s in (6, 8, 10)]


def test_best_pt_holds_the_step_of_the_best_logged_evaluation(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert train_main(small_sets(small_data, run, f"train.eval_every={EVERY}", "train.best_metric=auc")) == 0
    evals = _events(run, "eval")
    assert len(evals) == 2 * STEPS_PER_EPOCH // EVERY
    best_step, best, _ = _expected(evals, lower=False, patience=0)
    assert best_step == max(evals, key=lambda e: e["auc"])["step"]
    best_pt = run / "checkpoints" / "best.pt"
    assert verify_file(best_pt)  # its digest file vouches for it
    payload = torch.load(best_pt, weights_only=True)
    assert payload["step"] == best_step
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["best"] == {"metric": "auc", "value": pytest.approx(best, abs=1e-12), "step": best_step}
    assert [e["step"] for e in _events(run, "best")][-1] == best_step
    assert "early_stop" not in metrics and metrics["steps"] == 2 * STEPS_PER_EPOCH


def test_early_stop_ends_the_run_after_patience_evaluations_without_improvement(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert train_main(small_sets(small_data, run, *EARLY)) == 0
    evals = _events(run, "eval")
    best_step, _, stop = _expected(evals, lower=True, patience=2)
    assert stop is not None and stop < 2 * STEPS_PER_EPOCH  # the run did stop early
    assert evals[-1]["step"] == stop  # no evaluation after the stop
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == stop
    assert metrics["early_stop"] == {"stopped": True, "step": stop, "patience": 2}
    assert metrics["best"]["step"] == best_step and 0.0 < metrics["auc"] <= 1.0  # final evaluation as usual
    assert [(e["step"], e["best_step"]) for e in _events(run, "early_stop")] == [(stop, best_step)]
    assert torch.load(list_checkpoints(run)[-1], weights_only=True)["step"] == stop


@pytest.mark.parametrize("interrupt", [3, 4])  # between evaluations; at one (its checkpoint carries it)
def test_a_resumed_run_reaches_the_same_best_and_early_stop(small_data, tmp_path, interrupt):  # noqa: F811
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main(small_sets(small_data, full, *EARLY)) == 0
    assert train_main(small_sets(small_data, part, *EARLY, f"train.steps={interrupt}")) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    assert_same_run(full, part)
    best = [torch.load(run / "checkpoints" / "best.pt", weights_only=True) for run in (full, part)]
    assert_same_entries(*best)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("train.early_stop_patience=3",), "train.early_stop_patience=3 needs train.best_metric"),
        (("train.best_metric=auc",), "train.best_metric=auc needs periodic evaluations"),
        (("train.keep_checkpoints=0",), "train.keep_checkpoints"),
        (("train.eval_every=2", "train.best_metric=accuracy"), "'accuracy' is not an evaluation metric"),
    ],
)
def test_bad_checkpoint_choices_are_refused_in_one_line(small_data, tmp_path, capsys, extra, message):  # noqa: F811
    assert train_main(small_sets(small_data, tmp_path / "run", "train.steps=2", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def test_overwrite_deletes_best_pt_and_its_digest_file(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    names = ["best.pt", "best.pt.sha256", "best.tmp", "step-000000002.pt", "notes.txt"]
    for name in names:
        (folder / name).write_text("x")
    clear_run(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    ("metric", "mode", "lower"),
    [("auc", "auto", False), ("logloss", "auto", True), ("ne", "auto", True), ("query_rmse", "auto", True)]
    + [("logloss", "max", False), ("auc", "min", True), ("mean", "auto", False)],
)
def test_best_mode_auto_minimises_losses_and_errors(metric, mode, lower):
    assert lower_is_better(metric, mode) is lower


def test_a_changed_best_pt_fails_its_digest_check(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert (
        train_main(
            small_sets(small_data, run, "train.eval_every=7", "train.best_metric=auc", "train.steps=7")
        )
        == 0
    )
    best_pt = run / "checkpoints" / "best.pt"
    data = bytearray(best_pt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    best_pt.write_bytes(bytes(data))
    with pytest.raises(RecaccelError, match="best.pt"):
        verify_file(best_pt)


def test_a_malformed_best_entry_is_refused_in_one_line():
    for text in ('{"value": 1.0}', '{"value": 1.0, "step": -1, "evals_since": 0, "stopped_at": null}', "3"):
        with pytest.raises(ValueError, match="entry 'best'"):
            BestRecord.from_json(text)
    record = BestRecord(value=0.7, step=4, evals_since=1, stopped_at=None)
    assert BestRecord.from_json(record.to_json()) == record
