"""End-to-end: synthetic Parquet -> DLRM -> metrics, resume, CLI contract, bad input."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.train.checkpoint.state import list_checkpoints
from tests.helpers.dlrm_run import TINY, final_state, overrides, set_args

pytestmark = pytest.mark.numeric


def test_cli_trains_and_writes_run_dir(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_main(set_args(overrides(tiny_data, out, "train.epochs=2"))) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("auc", "logloss", "samples_per_s", "steps"):
        assert key in metrics
    assert 0.0 <= metrics["data_wait_fraction"] < 1.0
    assert metrics["data_wait_s"] >= 0.0 and metrics["data_startup_s"] > 0.0
    assert metrics["steps"] == 2 * (6000 // 256)
    assert 0.5 < metrics["auc"] <= 1.0
    resolved = load_config(out / "config.toml")
    assert resolved.train.epochs == 2 and resolved.model.embedding_dim == 8
    events = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "train" and events[-1]["event"] == "final"
    assert list_checkpoints(out)
    assert "auc" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["per_table", "reference"])
def test_resume_is_bit_identical(tiny_data, tmp_path, backend):
    common = ["train.epochs=3", f"model.embedding_backend={backend}", "optim.sparse=adam"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main(set_args(overrides(tiny_data, full, *common, "train.steps=40"))) == 0
    # Interrupted mid-epoch at step 17 (an epoch is 23 steps), then resumed to step 40.
    assert train_main(set_args(overrides(tiny_data, part, *common, "train.steps=17"))) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=40"]) == 0
    a, b = final_state(full), final_state(part)
    assert a["step"] == b["step"] == 40
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    ma = json.loads((full / "metrics.json").read_text())
    mb = json.loads((part / "metrics.json").read_text())
    assert ma["auc"] == mb["auc"] and ma["logloss"] == mb["logloss"]


def test_bad_config_is_one_line_error(tiny_data, tmp_path, capsys):
    code = train_main(set_args(overrides(tiny_data, tmp_path / "r", "model.top_mlp=[16, 2]")))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "model.top_mlp" in err
    code = train_main(["--config", str(tmp_path / "missing.toml")])
    assert code == 2 and "missing.toml" in capsys.readouterr().err


def test_bad_labels_name_file_and_column(tiny_data, tmp_path, capsys):
    src = sorted((tiny_data / "train").glob("*.parquet"))[0]
    table = pq.read_table(src)
    labels = table.column("label").to_numpy().copy()
    labels[5] = 2.0
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.float32()))
    pq.write_table(table, bad_dir / "part-00000.parquet", row_group_size=1000)
    code = train_main(set_args(overrides(tiny_data, tmp_path / "r", f'data.train="{bad_dir}"')))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "part-00000.parquet" in err and "label" in err


def test_missing_data_is_one_line_error(tmp_path, capsys):
    code = train_main(
        set_args([*TINY, f'data.train="{tmp_path / "nowhere"}"', f'train.out_dir="{tmp_path}"'])
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "nowhere" in err and len(err.splitlines()) == 1


def test_debug_preset_end_to_end(repo_root, tmp_path, capsys):
    """The README's main job on a reduced row count: synth then train from configs/debug.toml."""
    from recaccel.cli import data_main

    preset = str(repo_root / "configs" / "debug.toml")
    small = ["synth.train_rows=20000", "synth.test_rows=4000", f'synth.out_dir="{tmp_path / "data"}"']
    assert data_main(["synth", "--config", preset, *set_args(small)]) == 0
    report = json.loads(capsys.readouterr().out)
    run = [
        f'data.train="{tmp_path / "data" / "train"}"',
        f'data.test="{tmp_path / "data" / "test"}"',
        f'train.out_dir="{tmp_path / "run"}"',
        "train.progress=false",
    ]
    assert train_main(["--config", preset, *set_args(run)]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3 * (20000 // 512)
    assert 0.5 < metrics["auc"] <= report["bayes_auc"] + 0.02
    assert "bayes_auc (planted model)" in printed
    # A second synth call with the same config reuses the data instead of failing.
    assert data_main(["synth", "--config", preset, *set_args(small)]) == 0


def test_api_evaluate_scores_the_checkpoint_and_leaves_the_run_record(tiny_data, tmp_path):
    import recaccel.api as api

    out = tmp_path / "run"
    cfg = load_config(None, overrides(tiny_data, out, "train.steps=12"))
    metrics = api.train(cfg)
    record = {name: (out / name).read_bytes() for name in ("config.toml", "log.jsonl", "metrics.json")}
    other = load_config(None, overrides(tiny_data, out, "data.eval_batch_size=300"))
    again = api.evaluate(other)  # the newest checkpoint is the trained model: same scores
    assert again["auc"] == pytest.approx(metrics["auc"], abs=1e-6)
    assert again["logloss"] == pytest.approx(metrics["logloss"], abs=1e-6)
    on_train = api.evaluate(other, str(tiny_data / "train"))
    assert on_train["auc"] != again["auc"]
    assert {name: (out / name).read_bytes() for name in record} == record


def test_new_run_into_a_used_run_dir_needs_overwrite(tiny_data, tmp_path, capsys):
    """A second fresh run into a run directory is refused in one line; --overwrite clears the
    old run first (no mixed log, no old checkpoint a later --resume would continue)."""
    import recaccel.api as api
    from recaccel.errors import RecaccelError

    out = tmp_path / "run"
    argv = set_args(overrides(tiny_data, out, "train.steps=6", "train.checkpoint_every=5"))
    assert train_main(argv) == 0
    capsys.readouterr()
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "--overwrite" in err
    assert [p.name for p in list_checkpoints(out)] == ["step-000000005.pt", "step-000000006.pt"]
    with pytest.raises(RecaccelError, match="already holds a run"):
        api.train(load_config(None, overrides(tiny_data, out, "train.steps=3")))
    assert train_main(["--resume", str(out), "--overwrite"]) == 2

    (out / "checkpoints" / "step-000000099.pt").write_bytes(b"an old run's")
    assert train_main([*set_args(overrides(tiny_data, out, "train.steps=3")), "--overwrite"]) == 0
    assert [p.name for p in list_checkpoints(out)] == ["step-000000003.pt"]
    events = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["train", "final"] and events[-1]["steps"] == 3
    metrics = api.train(load_config(None, overrides(tiny_data, out, "train.steps=2")), overwrite=True)
    assert metrics["steps"] == 2 and json.loads((out / "metrics.json").read_text())["steps"] == 2
