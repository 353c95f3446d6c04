"""The sanity pass before training: bad evaluation data refused in one line before step 1,
a host cache too small for the first batches sized (or refused) at start, and runs and
resumes with the pass equal to those without it."""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from recaccel.train.checkpoint.paths import list_checkpoints
from recaccel.train.loop.trainer import Trainer
from recaccel.train.run import sanity
from tests.helpers.resume import SMALL, STEPS_PER_EPOCH, assert_same_run, meta_sets, small_sets

# 3 tables of 400 rows, one pack of 1,200: two 128-row training batches need about 400
# rows at once, the 400-row evaluation batch with them about 540.
WIDE = "synth.cardinality=400"
HOST = "model.embedding_placement=host"


def _synth(root: Path, *extra: str) -> Path:
    generate_synthetic(load_config(None, [*SMALL, *extra, f'synth.out_dir="{root}"']).synth)
    return root


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return _synth(tmp_path_factory.mktemp("synth"))


@pytest.fixture(scope="module")
def wide_data(tmp_path_factory) -> Path:
    return _synth(tmp_path_factory.mktemp("synth_wide"), WIDE)


def _argv(train: Path, test: Path | str, out: Path, *extra: str) -> list[str]:
    """``tests.helpers.resume.small_sets`` with another ``data.test``."""
    return [*small_sets(train.parent, out, *extra), "--set", f'data.test="{test}"']


def _refused(argv: list[str], capsys, pattern: str) -> str:
    """The run exits 2 with one stderr line matching ``pattern``."""
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert re.search(pattern, err), err
    return err


def _never_trained(run: Path) -> None:
    """No checkpoint, and no training step in log.jsonl (if there is one)."""
    assert not list_checkpoints(run)
    log = run / "log.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert not [e for e in events if e.get("event") == "train"]


def _no_pass(monkeypatch) -> None:
    monkeypatch.setattr(sanity, "_ENABLED", False)


# ------------------------------------------------------------ evaluation data


def test_out_of_range_test_ids_refused_before_training(tiny_data, tmp_path, capsys):
    # The same layout written with 60 ids per field: the model's tables (from data.train) have 30.
    other = _synth(tmp_path / "wider", "synth.cardinality=60")
    run = tmp_path / "run"
    pattern = (
        r"file .*test.*, column 'C\d': id (3\d|[45]\d) at row \d+ of the first evaluation batch is not a row "
        r"of the model's table \(valid ids are 0\.\.29; config key data\.test\)"
    )
    _refused(_argv(tiny_data / "train", other / "test", run), capsys, pattern)
    _never_trained(run)


def _plain(path: Path, rows: int, seed: int, *, item: str = "item", item_type: str = "int") -> None:
    """A Parquet file without recaccel metadata: label y, dense price, sparse item and user."""
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 50, rows)
    table = pa.table(
        {
            "y": rng.integers(0, 2, rows).astype(np.float32),
            "price": rng.random(rows),
            item: items.astype(str) if item_type == "str" else items,
            "user": rng.integers(0, 20, rows),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


MAPPING = 'data.schema={label="y", dense=["price"], sparse={item={cardinality=50}, user={cardinality=20}}}'


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("renamed", r"file .*test\.parquet, column 'item'.*data\.schema\.sparse\.item"),
        ("mistyped", r"file .*test\.parquet, column 'item'.*data\.schema\.sparse\.item"),
        (
            "other dense columns",
            r"file .*more/test: dense columns are \['I1', 'I2', 'I3'\], the model's \['I1', 'I2'\]",
        ),
    ],
)
def test_mismapped_test_columns_refused_before_training(tiny_data, tmp_path, capsys, case, pattern):
    run = tmp_path / "run"
    if case == "other dense columns":  # stored schemas: the test data has a third dense column
        other = _synth(tmp_path / "more", "synth.num_dense=3")
        argv = _argv(tiny_data / "train", other / "test", run)
    else:  # a [data.schema] mapping the test file does not follow
        _plain(tmp_path / "train.parquet", 600, 0)
        kind = {"renamed": {"item": "item_id"}, "mistyped": {"item_type": "str"}}[case]
        _plain(tmp_path / "test.parquet", 200, 1, **kind)
        argv = _argv(tmp_path / "train.parquet", tmp_path / "test.parquet", run, MAPPING)
        argv += ["--set", f'data.train="{tmp_path / "train.parquet"}"']
    _refused(argv, capsys, pattern)
    _never_trained(run)


@pytest.mark.parametrize("key", ["data.test", "meta.eval_states"])
def test_empty_test_file_refused_before_training(tiny_data, tmp_path, capsys, key):
    first = sorted((tiny_data / "train").glob("*.parquet"))[0]
    empty = tmp_path / "empty" / "part-00000.parquet"
    empty.parent.mkdir()
    pq.write_table(pq.read_table(first).slice(0, 0), empty)  # the schema and its metadata, no row
    run = tmp_path / "run"
    if key == "data.test":
        argv = _argv(tiny_data / "train", empty.parent, run)
        pattern = r"file .*empty: no evaluation row could be read \(config key data\.test\)"
    else:
        argv = small_sets(tiny_data, run, f'meta.eval_states=["cold={empty.parent}"]')
        pattern = r"file .*empty: no evaluation row could be read \(config key meta\.eval_states\[0\]\)"
    _refused(argv, capsys, pattern)
    _never_trained(run)


# ------------------------------------------------------------ host cache


def test_eval_batch_larger_than_cache_is_sized_at_start(wide_data, tmp_path, caplog, monkeypatch):
    # 480 slots hold two training batches (~400 rows) but not the 400-row evaluation batch with them.
    small = (HOST, "model.cache_fraction=0.4")
    device, before, after = tmp_path / "device", tmp_path / "before", tmp_path / "after"
    assert train_main(small_sets(wide_data, device)) == 0
    with monkeypatch.context() as m:  # without the pass: trained, then refused at evaluation
        _no_pass(m)
        assert train_main(small_sets(wide_data, before, *small)) == 2
    assert list_checkpoints(before) and not (before / "metrics.json").exists()
    with caplog.at_level(logging.WARNING, logger="recaccel.train.run.sanity"):
        assert train_main(small_sets(wide_data, after, *small)) == 0
    sized = [r.getMessage() for r in caplog.records if "sized at start" in r.getMessage()]
    assert len(sized) == 1 and "480 -> " in sized[0] and "evaluation batch" in sized[0], sized
    a, b = (json.loads((run / "metrics.json").read_text()) for run in (device, after))
    assert b["cache_rows"] > 480
    for key in ("auc", "logloss", "train_loss", "steps", "train_samples"):
        assert a[key] == b[key], key  # the cache's size changes traffic, not results


def test_capped_cache_shortens_the_lookahead_at_start(wide_data, tmp_path, caplog):
    run = tmp_path / "run"
    capped = (HOST, "model.cache_rows=560", "model.cache_lookahead=3")
    with caplog.at_level(logging.WARNING, logger="recaccel.train.run.sanity"):
        assert train_main(small_sets(wide_data, run, *capped)) == 0
    said = [r.getMessage() for r in caplog.records if "lookahead shortened" in r.getMessage()]
    assert len(said) == 1 and "model.cache_rows=560 caps: lookahead shortened to 1" in said[0], said
    assert "cache_lookahead = 1" in (run / "config.toml").read_text()
    assert json.loads((run / "metrics.json").read_text())["cache_rows"] == 560


def test_capped_cache_too_small_for_one_window_refused_at_start(wide_data, tmp_path, capsys):
    run = tmp_path / "run"
    pattern = (
        r"has 480 rows \(model\.cache_rows=480\), but an evaluation batch with the 2 training batches the "
        r"window locks needs (\d+) unique rows even at model\.cache_lookahead=1; raise model\.cache_rows to "
        r"at least \1"
    )
    _refused(small_sets(wide_data, run, HOST, "model.cache_rows=480"), capsys, pattern)
    _never_trained(run)


# ------------------------------------------------------------ no trace


def _twice(monkeypatch, argv_of, runs: Path) -> tuple[Path, Path]:
    """The same run(s) with the pass and without; ``argv_of(out)`` lists each call's argv."""
    with_pass, without = runs / "with", runs / "without"
    for out, enabled in ((with_pass, True), (without, False)):
        monkeypatch.setattr(sanity, "_ENABLED", enabled)
        for argv in argv_of(out):
            assert train_main(argv) == 0
    return with_pass, without


@pytest.mark.parametrize("case", ["dlrm", "host", "meta", "host resumed"])
def test_sanity_pass_changes_no_training_result(tiny_data, wide_data, task_data, tmp_path, monkeypatch, case):  # noqa: F811
    every = f"train.checkpoint_every={STEPS_PER_EPOCH}"
    host = (every, HOST, "model.cache_rows=700")
    if case == "dlrm":  # with an extra evaluation state: both sources pass through the model
        test = tiny_data / "test"
        argv_of = lambda out: [small_sets(tiny_data, out, every, f'meta.eval_states=["again={test}"]')]
    elif case == "host":
        argv_of = lambda out: [small_sets(wide_data, out, *host)]
    elif case == "meta":
        train, test = task_data
        argv_of = lambda out: [meta_sets(train, test, out, "train.checkpoint_every=6")]
    else:  # the pass runs again on the resume
        argv_of = lambda out: [
            small_sets(wide_data, out, *host, f"train.steps={STEPS_PER_EPOCH + 4}"),
            ["--resume", str(out), "--set", "train.steps=0"],
        ]
    with_pass, without = _twice(monkeypatch, argv_of, tmp_path)
    # Every metric (cache counters too) and checkpoint entry; the task reader's decode-work
    # counters depend on when its worker threads ran (README: a known gap), so not those.
    measured = ("max_buffered_rows", "rows_read", "row_groups_read") if case == "meta" else ()
    assert_same_run(without, with_pass, measured=measured)


def test_sanity_pass_leaves_generators_model_and_cache_as_they_were(wide_data, tmp_path):
    cfg = load_config(None, [*SMALL, HOST, "model.cache_rows=700", f'train.out_dir="{tmp_path / "run"}"'])
    cfg.data.train, cfg.data.test = str(wide_data / "train"), str(wide_data / "test")
    trainer = Trainer(cfg)
    embedding = trainer.objective.module.sparse_arch.embedding
    before = {k: v.clone() for k, v in trainer.objective.module.state_dict().items()}
    rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    stats = embedding.cache_stats()
    sanity.sanity_pass(trainer)
    after = trainer.objective.module.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng[0], torch.get_rng_state()) and np.array_equal(rng[1], np.random.get_state()[1])
    assert rng[2] == random.getstate()
    assert embedding.cache_stats() == stats and stats["cache_requests"] == 0
    assert trainer.objective.module.training  # the mode it was built in
