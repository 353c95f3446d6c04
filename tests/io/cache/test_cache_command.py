"""``recaccel-data cache SRC DST``: builds a cache under a config's policies, prints its
summary, and refuses a folder that holds files in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recaccel.cli import data_main, train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from recaccel.io.format.decode import Policies
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers import BatchReader, ReadOptions
from tests.helpers.dlrm_run import TINY, overrides
from tests.helpers.row_data import make_columns, make_schema
from tests.helpers.same_batches import assert_same_batches


def test_cache_command_builds_under_the_configs_policies_and_prints_a_summary(tmp_path, capsys):
    schema = make_schema(2, [False, True], [30, 9])
    cols = make_columns(schema, 80, 6)
    cols["s0"][[3, 41]] = -1  # two rows a skip policy drops
    write_parquet(tmp_path / "src", schema, cols, rows_per_row_group=20)
    config = tmp_path / "skip.toml"
    config.write_text('[data]\ninvalid_ids = "skip"\n')
    assert data_main(["cache", str(tmp_path / "src"), str(tmp_path / "dst"), "--config", str(config)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["rows"] == 78 and report["row_groups"] == 4 and report["bytes"] > 0 and report["seconds"] >= 0
    )
    opts = ReadOptions(seed=2, policies=Policies(invalid_ids="skip"))
    assert_same_batches(
        list(BatchReader(tmp_path / "src", 8, opts)), list(BatchReader(tmp_path / "dst", 8, opts))
    )
    assert np.fromfile(tmp_path / "dst" / "labels.f32", dtype="<f4").shape == (78,)


def test_cache_command_refuses_a_folder_that_holds_files_in_one_line(tmp_path, capsys):
    schema = make_schema(1, [False], [5])
    write_parquet(tmp_path / "src", schema, make_columns(schema, 10, 1), rows_per_row_group=5)
    (tmp_path / "dst").mkdir()
    Path(tmp_path / "dst" / "notes.txt").write_text("mine")
    assert data_main(["cache", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recaccel-data: error: DST ") and "--force" in err and "\n" not in err
    assert (tmp_path / "dst" / "notes.txt").read_text() == "mine"
    assert data_main(["cache", str(tmp_path / "src"), str(tmp_path / "dst"), "--force"]) == 0
    assert (tmp_path / "dst" / "cache.json").is_file() and not (tmp_path / "dst" / "notes.txt").exists()


def _train(data: Path, train: Path, out: Path) -> dict:
    args = ["--no-progress", "-q"]
    for item in overrides(data, out, "train.epochs=2", "data.workers=0"):
        args += ["--set", item]
    assert train_main([*args, "--set", f'data.train="{train}"']) == 0
    return json.loads((out / "metrics.json").read_text())


def test_recaccel_train_on_a_cache_folder_equals_training_on_its_parquet_source(tmp_path):
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{tmp_path / "data"}"']).synth)
    assert data_main(["cache", str(tmp_path / "data" / "train"), str(tmp_path / "cached")]) == 0
    parquet = _train(tmp_path / "data", tmp_path / "data" / "train", tmp_path / "run_parquet")
    cached = _train(tmp_path / "data", tmp_path / "cached", tmp_path / "run_cache")
    for key in ("auc", "logloss", "train_loss", "steps"):
        assert cached[key] == parquet[key], key
    assert cached["data"] == parquet["data"]


def test_recaccel_train_refuses_a_damaged_cache_manifest_in_one_line(tmp_path, capsys):
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{tmp_path / "data"}"']).synth)
    assert data_main(["cache", str(tmp_path / "data" / "train"), str(tmp_path / "cached")]) == 0
    (tmp_path / "cached" / "cache.json").write_text("{ not json")
    args = []
    for item in overrides(tmp_path / "data", tmp_path / "run"):
        args += ["--set", item]
    capsys.readouterr()
    assert train_main([*args, "--set", f'data.train="{tmp_path / "cached"}"']) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recaccel-train: error: config key data.train=") and "cache.json" in err
    assert "\n" not in err
