"""recaccel-eval and recaccel-export never replace a run's files, its checkpoint or its
data (even with --force), nor an existing output without --force; the refusal comes
before any evaluation or export, in one line, and leaves every file byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recaccel.cli import eval_main, export_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from tests.helpers.export_run import EXPORT_TINY, train_run

STEP = 4  # the run's newest checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("outputs")
    generate_synthetic(load_config(None, [*EXPORT_TINY, f'synth.out_dir="{root / "data"}"']).synth)
    return train_run(root / "data", root / "run")


def _checkpoint(run: Path) -> Path:
    return run / "checkpoints" / f"step-{STEP:09d}.pt"


def _test_part(run: Path) -> Path:
    return sorted(Path(load_config(run / "config.toml").data.test).glob("*.parquet"))[0]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def no_evaluation(monkeypatch):
    """Fails the test if the command gets as far as evaluating."""

    def evaluate(*args, **kwargs):
        raise AssertionError("evaluated before refusing the output")

    monkeypatch.setattr("recaccel.api.evaluate", evaluate)


def test_eval_refuses_an_existing_predictions_file_without_force_before_evaluating(
    run, tmp_path, capsys, no_evaluation
):
    preds = tmp_path / "preds.parquet"
    preds.write_bytes(b"yesterday's predictions")
    assert eval_main([str(run), "--out", str(tmp_path / "m.json"), "--predictions", str(preds)]) == 2
    err = _error_line(capsys)
    assert err == f"recaccel-eval: error: --predictions {preds} exists (pass --force to replace it)"
    assert preds.read_bytes() == b"yesterday's predictions" and not (tmp_path / "m.json").exists()


def test_eval_with_force_replaces_existing_outputs(run, tmp_path, capsys):
    preds, out = tmp_path / "preds.parquet", tmp_path / "m.json"
    preds.write_bytes(b"old")
    out.write_text("old")
    assert eval_main([str(run), "--out", str(out), "--predictions", str(preds), "--force"]) == 0
    assert json.loads(out.read_text())["checkpoint_step"] == STEP
    assert pq.read_table(preds).num_rows == 200 and sorted(tmp_path.iterdir()) == [out, preds]
    capsys.readouterr()


def test_eval_refuses_its_default_metrics_file_when_it_exists(run, capsys, no_evaluation):
    default = run / f"eval-{STEP}.json"
    default.write_text('{"auc": 0.7}\n')
    try:
        assert eval_main([str(run)]) == 2
        err = _error_line(capsys)
        assert err == f"recaccel-eval: error: the metrics file {default} exists (pass --force to replace it)"
        assert default.read_text() == '{"auc": 0.7}\n'
    finally:
        default.unlink()


@pytest.mark.parametrize(
    ("flag", "target", "why"),
    [
        ("--predictions", "data", "is the data this command reads"),
        ("--predictions", "checkpoint", "is inside the run's own checkpoints"),
        ("--out", "config", "is the run's own config.toml"),
        ("--out", "log", "is the run's own log.jsonl"),
    ],
)
def test_eval_refuses_to_write_over_what_it_reads_even_with_force(
    run, tmp_path, capsys, no_evaluation, flag, target, why
):
    path = {
        "data": _test_part(run),
        "checkpoint": _checkpoint(run),
        "config": run / "config.toml",
        "log": run / "log.jsonl",
    }[target]
    before = path.read_bytes()
    argv = [str(run), "--force", "--data", str(path) if target == "data" else str(_test_part(run).parent)]
    if flag == "--predictions":
        argv += ["--out", str(tmp_path / "m.json")]
    assert eval_main([*argv, flag, str(path)]) == 2
    assert _error_line(capsys) == f"recaccel-eval: error: {flag} {path} {why}; write it elsewhere"
    assert path.read_bytes() == before


def test_eval_refuses_predictions_over_its_own_metrics_file(run, tmp_path, capsys, no_evaluation):
    same = tmp_path / "both"
    assert eval_main([str(run), "--out", str(same), "--predictions", str(same)]) == 2
    assert "is the metrics file this command writes" in _error_line(capsys)


def test_export_refuses_an_existing_out_without_force_and_replaces_it_with_force(run, tmp_path, capsys):
    out = tmp_path / "model.pt"
    out.write_bytes(b"last week's model")
    assert export_main([str(run), str(out), "--format", "torchrec"]) == 2
    err = _error_line(capsys)
    assert err == f"recaccel-export: error: OUT {out} exists (pass --force to replace it)"
    assert out.read_bytes() == b"last week's model" and not out.with_suffix(".json").exists()
    assert export_main([str(run), str(out), "--format", "torchrec", "--force"]) == 0
    assert out.read_bytes() != b"last week's model"
    assert json.loads(out.with_suffix(".json").read_text())["source"]["step"] == STEP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.pt"]  # no temporary left
    capsys.readouterr()


def test_export_refuses_to_write_over_the_runs_newest_checkpoint_even_with_force(run, capsys):
    checkpoint = _checkpoint(run)
    before = checkpoint.read_bytes()
    assert export_main([str(run), str(checkpoint), "--format", "torchrec", "--force"]) == 2
    err = _error_line(capsys)
    assert err == (
        f"recaccel-export: error: OUT {checkpoint} is inside the run's own checkpoints; write it elsewhere"
    )
    assert checkpoint.read_bytes() == before and not checkpoint.with_suffix(".json").exists()


def test_export_refuses_a_description_over_the_runs_metrics(run, capsys):
    metrics = run / "metrics.json"
    before = metrics.read_bytes()
    assert export_main([str(run), str(run / "metrics.pt"), "--format", "torchrec", "--force"]) == 2
    err = _error_line(capsys)
    assert err.endswith(f"OUT's description {metrics} is the run's own metrics.json; write it elsewhere")
    assert metrics.read_bytes() == before and not (run / "metrics.pt").exists()


def test_eval_set_value_with_a_newline_is_refused_naming_the_key(run, tmp_path, capsys):
    out = tmp_path / "m.json"
    argv = [str(run), "--out", str(out), "--set", "data.eval_batch_size=64\ndata.test=elsewhere"]
    assert eval_main(argv) == 2
    err = _error_line(capsys)
    assert err.startswith("recaccel-eval: error: override 'data.eval_batch_size': the value holds a control")
    assert not out.exists()
