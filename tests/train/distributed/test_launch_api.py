"""``recaccel.launch``: N ranks from Python, what ``recaccel-train --nproc N`` runs."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest

import recaccel
from recaccel.config import Config, load_config
from recaccel.errors import ConfigError, RecaccelError
from recaccel.io.convert.synth import generate_synthetic

TINY = [
    "synth.train_rows=1200",
    "synth.test_rows=400",
    "synth.num_dense=3",
    "synth.num_sparse=3",
    "synth.cardinality=40",
    "synth.multi_hot_fields=1",
    "synth.rows_per_row_group=200",
    "synth.rows_per_file=600",
    "data.batch_size=64",
    "data.shuffle_buffer_rows=400",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.progress=false",
    "train.steps=6",
    "train.log_every=3",
    "optim.sparse=rowwise_adagrad",
    "parallel.mode=hybrid",
]
COMPARED = ("auc", "logloss", "train_loss", "steps", "train_samples")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    pytest.importorskip("torchrec", exc_type=ImportError)
    root = tmp_path_factory.mktemp("launch-data")
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{root}"']).synth)
    return root


def _sets(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]


def _config(data: Path, out: Path, *extra: str) -> Config:
    return load_config(None, _sets(data, out, *extra))


@pytest.fixture(scope="module")
def launched(data, tmp_path_factory) -> tuple[Path, dict]:
    """A run of two ranks started from Python, and what ``launch`` returned."""
    out = tmp_path_factory.mktemp("launched") / "run"
    return out, recaccel.launch(_config(data, out), nproc=2)


def test_launch_returns_the_metrics_rank_0_wrote(launched):
    out, metrics = launched
    assert metrics == json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["train_samples"] == 6 * 64
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000000006.dcp"]


def test_launch_trains_as_the_cli_does_on_the_same_config(data, launched, tmp_path, capsys):
    from recaccel.cli import train_main

    _, metrics = launched
    out = tmp_path / "cli"
    argv = [arg for s in _sets(data, out) for arg in ("--set", s)]
    assert train_main([*argv, "--nproc", "2"]) == 0
    assert capsys.readouterr().out.count("metrics written to") == 1  # the launcher reports once
    by_cli = json.loads((out / "metrics.json").read_text())
    for key in COMPARED:
        assert by_cli[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key


def test_launch_of_one_rank_trains_as_train_does(data, tmp_path):
    launched = recaccel.launch(_config(data, tmp_path / "one"), nproc=1)
    # In this process the same model is the single-process one (hybrid needs torchrun).
    single = ("parallel.mode=single", "model.embedding_backend=reference")
    trained = recaccel.train(_config(data, tmp_path / "train", *single))
    assert launched["steps"] == trained["steps"] and launched["train_samples"] == trained["train_samples"]
    for key in ("auc", "logloss", "train_loss"):
        assert abs(launched[key] - trained[key]) <= 1e-5, key


@pytest.mark.parametrize(
    ("extra", "kwargs", "message"),
    [
        ((), {"nproc": 0}, "--nproc must be >= 1, got 0"),
        (("parallel.mode=single",), {"nproc": 2}, "needs parallel.mode=hybrid (got 'single')"),
        ((), {"nproc": 2, "max_restarts": -1}, "--max-restarts must be >= 0, got -1"),
        ((), {"nproc": 2, "resume": True, "overwrite": True}, "--overwrite would delete it: pass one"),
    ],
)
def test_bad_launch_arguments_are_one_line_before_any_rank_starts(data, tmp_path, extra, kwargs, message):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        recaccel.launch(_config(data, out, *extra), **kwargs)
    assert "\n" not in str(error.value) and message in str(error.value)
    assert not out.exists()


def test_resume_of_sharded_data_on_another_world_size_is_one_line(launched):
    out, _ = launched
    cfg = recaccel.api.run_config(out, ["parallel.data=sharded"])
    before = (out / "log.jsonl").read_text()
    with pytest.raises(RecaccelError) as error:
        recaccel.launch(cfg, nproc=3, resume=True)
    assert "\n" not in str(error.value)
    assert "written by 2 ranks with parallel.data=sharded" in str(error.value) and "--nproc 2" in str(
        error.value
    )
    assert (out / "log.jsonl").read_text() == before  # no rank started


def test_launch_on_a_run_dir_holding_a_run_is_refused_in_one_line(launched):
    out, _ = launched
    cfg = recaccel.api.run_config(out)
    with pytest.raises(RecaccelError) as error:
        recaccel.launch(cfg, nproc=2)
    assert "\n" not in str(error.value) and f"run directory {out} already holds a run" in str(error.value)


def test_resumed_launch_continues_the_run(launched, tmp_path):
    out, _ = launched
    cfg = recaccel.api.run_config(out, ["train.steps=8"])
    copy = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(tmp_path / "copy")))
    shutil.copytree(out, copy.train.out_dir)
    metrics = recaccel.launch(copy, nproc=2, resume=True)
    assert metrics["steps"] == 8 and metrics["train_samples"] == 8 * 64


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``import m``) and every ``m.name`` (``from m import name``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_train_command_holds_no_launch_logic():
    import recaccel.cli.train as command

    imported = _imports(Path(command.__file__))
    # Only what a rank reads from its environment may come from the launch module.
    allowed = {
        "recaccel.train.distributed.launch.restart_count",
        "recaccel.train.distributed.launch.under_torchrun",
    }
    launching = (
        "subprocess",
        "multiprocessing",
        "torch",
        "recaccel.train.run.run_lock",
        "recaccel.train.run.runlog",
        "recaccel.train.distributed.",
    )
    assert not [m for m in imported - allowed if m.startswith(launching)], sorted(imported)
    assert not {"_launch", "_ranks_until_stopped"} & set(vars(command))


@pytest.mark.parametrize(
    ("level", "flags"),
    [(logging.DEBUG, ["--verbose"]), (logging.INFO, []), (logging.CRITICAL + 1, ["--quiet"])],
)
def test_ranks_print_as_the_launching_process_chose(level, flags):
    from recaccel.train.distributed.launcher import rank_loudness
    from recaccel.train.run.console import console, show_console

    saved = console.level, list(console.handlers), console.propagate
    try:
        show_console(level)  # what -v, neither, -q set
        assert rank_loudness() == flags
    finally:
        console.level, console.handlers, console.propagate = saved
