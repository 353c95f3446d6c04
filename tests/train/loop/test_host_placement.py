"""Host-placed tables from the CLI: the same training as device placement, exact resume,
the cache's traffic in the log and metrics.json, one-line refusals."""

from __future__ import annotations

import json
import re

import pytest

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from tests.helpers.resume import (
    SMALL,
    STEPS_PER_EPOCH,
    assert_same_entries,
    final_entries,
    meta_sets,
    small_sets,
)

# 3 tables of 400 rows (Zipf ids), one pack of 1,200 rows; a 128-row batch needs about
# 400 of them, and the window locks the previous batch's too, so a 700-row cache evicts (and writes back dirty rows) at most batches.
WIDE = "synth.cardinality=400"
HOST = ("model.embedding_placement=host", "model.cache_rows=700", "model.cache_lookahead=1")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth_wide")
    generate_synthetic(load_config(None, [*SMALL, WIDE, f'synth.out_dir="{root}"']).synth)
    return root


@pytest.fixture(scope="module")
def full_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("device") / "run"
    assert train_main(small_sets(tiny_data, out, f"train.checkpoint_every={STEPS_PER_EPOCH}")) == 0
    return out


CACHE_KEYS = {
    "cache_hit_rate",
    "cache_rows_fetched",
    "cache_rows_evicted",
    "cache_bytes_h2d",
    "cache_bytes_d2h",
}


def _metrics(run) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _same_training(full, run) -> None:
    a, b = _metrics(full), _metrics(run)
    for key in ("auc", "logloss", "train_loss", "steps", "train_samples", "data"):
        assert a[key] == b[key], key
    assert_same_entries(final_entries(full)["model"], final_entries(run)["model"])
    assert_same_entries(final_entries(full)["optimizer"], final_entries(run)["optimizer"])


def test_host_placement_trains_bit_identical_to_device(tiny_data, full_run, tmp_path):
    run = tmp_path / "host"
    assert train_main(small_sets(tiny_data, run, f"train.checkpoint_every={STEPS_PER_EPOCH}", *HOST)) == 0
    _same_training(full_run, run)
    metrics = _metrics(run)
    assert CACHE_KEYS <= set(metrics)
    assert metrics["cache_rows_evicted"] > 0 and metrics["cache_bytes_d2h"] > 0  # write-backs happened
    assert 0.0 < metrics["cache_hit_rate"] < 1.0
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    assert all("cache_rows_fetched_per_step" in e and "cache_hit_rate" in e for e in train)


@pytest.mark.parametrize("lookahead", [2, 3])
def test_host_placement_with_lookahead_and_sync_pipeline(tiny_data, full_run, tmp_path, lookahead):
    run = tmp_path / "host"
    extra = (HOST[0], "model.cache_rows=1100", f"model.cache_lookahead={lookahead}", "train.pipeline=sync")
    assert train_main(small_sets(tiny_data, run, f"train.checkpoint_every={STEPS_PER_EPOCH}", *extra)) == 0
    _same_training(full_run, run)


def test_host_placement_resumes_exactly(tiny_data, full_run, tmp_path):
    run = tmp_path / "part"
    extra = (f"train.checkpoint_every={STEPS_PER_EPOCH}", *HOST, f"train.steps={STEPS_PER_EPOCH + 4}")
    assert train_main(small_sets(tiny_data, run, *extra)) == 0
    assert train_main(["--resume", str(run), "--set", "train.steps=0"]) == 0
    _same_training(full_run, run)


def test_meta_host_placement_trains_bit_identical_to_device(task_data, tmp_path):  # noqa: F811
    train, test = task_data
    device, host = tmp_path / "device", tmp_path / "host"
    assert train_main(meta_sets(train, test, device)) == 0
    assert (
        train_main(meta_sets(train, test, host, "model.embedding_placement=host", "model.cache_fraction=1.0"))
        == 0
    )
    a, b = _metrics(device), _metrics(host)
    for key in ("steps", "train_samples", "train_loss", "mae"):
        assert a.get(key) == b.get(key), key
    assert_same_entries(final_entries(device)["model"], final_entries(host)["model"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (("model.embedding_placement=host", "model.cache_rows=10"), r"needs \d+ unique rows"),
        (('model.table_placement=["nope=host"]',), r"model.table_placement names table 'nope'"),
        (
            ("model.embedding_placement=host", "model.embedding_backend=per_table"),
            r"per_table keeps every table",
        ),
    ],
)
def test_host_placement_refusals_are_one_line(tiny_data, tmp_path, capsys, extra, message):
    assert train_main(small_sets(tiny_data, tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert re.search(message, err), err
