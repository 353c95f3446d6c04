"""recaccel-eval's default metrics file: eval-<step>.json for the run's own data.test, and
eval-<step>-<hash>.json for other --data, so an evaluation of one step on other data never
overwrites another's; --overwrite of the run deletes both kinds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from recaccel.cli import eval_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from recaccel.train.evaluation.from_checkpoint import eval_file_name
from recaccel.train.run.runlog import run_files
from tests.helpers.export_run import EXPORT_TINY, train_run

STEP = 4  # the run's newest checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval_names")
    generate_synthetic(load_config(None, [*EXPORT_TINY, f'synth.out_dir="{root / "data"}"']).synth)
    return train_run(root / "data", root / "run")


def _short_hash(path: Path) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]


def test_other_data_gets_its_own_metrics_file_beside_the_test_sets(run, capsys):
    cfg = load_config(run / "config.toml")
    other = Path(cfg.data.train)
    assert eval_main([str(run)]) == 0
    assert eval_main([str(run), "--data", str(other)]) == 0
    own = json.loads((run / f"eval-{STEP}.json").read_text())
    named = run / f"eval-{STEP}-{_short_hash(other)}.json"
    theirs = json.loads(named.read_text())
    assert own["data"] == cfg.data.test and theirs["data"] == str(other)
    assert own["eval_rows"] != theirs["eval_rows"]  # two evaluations, two files
    assert f"metrics written to {named}" in capsys.readouterr().out
    # The same data again is refused in one line without --force, replaced with it.
    assert eval_main([str(run), "--data", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"recaccel-eval: error: the metrics file {named} exists (pass --force to replace it)"
    assert eval_main([str(run), "--data", str(other), "--force"]) == 0
    assert {f"eval-{STEP}.json", named.name} <= set(run_files(run))


def test_the_run_test_set_named_any_way_keeps_the_plain_name(tmp_path):
    test = tmp_path / "data" / "test"
    test.mkdir(parents=True)
    assert eval_file_name(7, test, test) == "eval-7.json"
    assert eval_file_name(7, tmp_path / "data" / ".." / "data" / "test", test) == "eval-7.json"
    other = eval_file_name(7, tmp_path / "data" / "train", test)
    assert other == f"eval-7-{_short_hash(tmp_path / 'data' / 'train')}.json"
    assert other != eval_file_name(7, tmp_path / "elsewhere", test)
