"""Checkpoints written by an older recaccel load and resume after a refactor.

``tests/fixtures/checkpoints_2026_11_23`` holds a DLRM run stopped mid-epoch (step 17 of
28) and a meta-DLRM run stopped at step 5, written by commit 89cdcc5 (before the data
package's layout change) on the tiny datasets of ``test_resume_matrix``, which are
regenerated here from their seeds.

The fixtures' floats came from another host, whose SIMD kernels and summation order
differ from this one's in the last bits, so nothing here compares them bit for bit:

- an old file holds what today's code writes at the same step: the same entries, keys,
  shapes, dtypes, counters, reader position and RNG streams exactly, its numbers within
  a tolerance;
- resumed, it continues exactly (on this host) as today's checkpoint of that step does
  once it holds the old file's model and optimizer;
- the resumed run ends within tolerance of today's uninterrupted run.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from recaccel.cli import train_main
from recaccel.train.checkpoint.digests import file_sha256, write_digests
from recaccel.train.checkpoint.state import list_checkpoints
from tests.helpers.meta_run import write_ratings
from tests.helpers.resume import (
    STEPS_PER_EPOCH,
    TIMING_ENTRIES,
    TIMING_KEYS,
    assert_same_run,
    meta_sets,
    small_sets,
)

pytestmark = pytest.mark.numeric

FIXTURES = Path(__file__).parents[2] / "fixtures" / "checkpoints_2026_11_23"
DLRM_STEP, META_STEP = 17, 5
# The task reader's decode work and memory high-water mark are measurements: they vary
# from run to run (see test_resume_matrix).
META_MEASURED = ("max_buffered_rows", "rows_read", "row_groups_read")
# Another host's kernels move a float by ~1e-9 relative per step; a wrong reader
# position, a dropped optimizer state or a lost RNG stream moves it by >1e-2.
RTOL = 1e-4
# Optimizer param-group flags that choose kernels for the device (see recaccel.train.model.optim),
# not training state: an old CPU file may differ from today's on a GPU.
KERNEL_FLAGS = {"foreach", "fused", "capturable", "differentiable"}


def _unpack(name: str, data_root: Path, run: Path) -> Path:
    """The fixture run copied to ``run``, its config pointed at ``data_root``."""
    shutil.copytree(FIXTURES / name, run)
    config = run / "config.toml"
    config.write_text(
        config.read_text().replace("@DATA@/" + name, str(run)).replace("@DATA@", str(data_root))
    )
    return run


def _newest(run: Path) -> dict[str, Any]:
    found = list_checkpoints(run)
    assert found, f"no checkpoint in {run}"
    return torch.load(found[-1], weights_only=True)


def _first_trained_step(run: Path) -> int:
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return min(e["step"] for e in events if e["event"] == "train")


def _comparable(entries: dict[str, Any], measured: tuple[str, ...]) -> dict[str, Any]:
    """The checkpoint entries with the reader position and counters decoded from JSON, the
    ``measured`` counters and the optimizer's kernel flags left out."""
    out = dict(entries)
    data = json.loads(entries["data"])
    out["data"] = {k: v for k, v in data.items() if k not in measured}
    out["optimizer"] = dict(entries["optimizer"])
    out["optimizer"]["param_groups"] = [
        {k: v for k, v in g.items() if k not in KERNEL_FLAGS} for g in entries["optimizer"]["param_groups"]
    ]
    reader = json.loads(entries["reader"])
    if reader is not None:  # None: the run's last step, nothing left to read
        reader["counters"] = {k: v for k, v in reader["counters"].items() if k not in measured}
    out["reader"] = reader
    return out


def assert_close_entries(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` hold the same structure, dtypes, shapes, integers and strings, and
    floats within ``RTOL`` (a tensor's elements relative to its largest magnitude)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            if key not in TIMING_ENTRIES:
                assert_close_entries(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_entries(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (where, a.dtype, a.shape, b.dtype, b.shape)
        if not a.is_floating_point():
            assert torch.equal(a, b), where
        elif a.numel():
            scale = max(b.abs().max().item(), torch.finfo(b.dtype).tiny)
            assert (a.double() - b.double()).abs().max().item() <= RTOL * scale, where
    elif isinstance(a, float) and not isinstance(b, bool):
        assert isinstance(b, (int, float)), where
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12), (
            where,
            a,
            b,
        )
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def _metrics(run: Path, measured: tuple[str, ...] = ()) -> dict[str, Any]:
    metrics = json.loads((run / "metrics.json").read_text())
    for key in TIMING_KEYS:
        metrics.pop(key)
    for key in measured:
        metrics["data"].pop(key)
    return metrics


def _spliced(today: Path, old: dict[str, Any], run: Path) -> Path:
    """A copy of today's run whose newest checkpoint holds the old file's model, optimizer
    and last loss (the entries computed in floats) and keeps today's other entries."""
    shutil.copytree(today, run)
    path = list_checkpoints(run)[-1]
    entries = torch.load(path, weights_only=True)
    entries.update(model=old["model"], optimizer=old["optimizer"], last_loss=old["last_loss"])
    torch.save(entries, path)
    write_digests(path, [file_sha256(path)])  # changed on purpose: its recorded digest would refuse it
    return run


# DLRM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dlrm_old() -> dict[str, Any]:
    return torch.load(FIXTURES / "dlrm" / "checkpoints" / f"step-{DLRM_STEP:09d}.pt", weights_only=True)


@pytest.fixture(scope="module")
def dlrm_today(small_data, tmp_path_factory) -> Path:  # noqa: F811
    """Today's code stopped at the old checkpoint's step, on this host."""
    out = tmp_path_factory.mktemp("dlrm_today") / "run"
    every = f"train.checkpoint_every={STEPS_PER_EPOCH}"
    assert train_main(small_sets(small_data, out, every, f"train.steps={DLRM_STEP}")) == 0
    return out


@pytest.fixture(scope="module")
def dlrm_resumed(small_data, tmp_path_factory) -> Path:  # noqa: F811
    """The old checkpoint resumed to the end of its run by today's code."""
    tmp = tmp_path_factory.mktemp("dlrm_old")
    root = tmp / "data"
    root.mkdir()
    (root / "synth").symlink_to(small_data)
    run = _unpack("dlrm", root, tmp / "dlrm")
    assert train_main(["--resume", str(run), "--set", "train.steps=0"]) == 0
    assert _first_trained_step(run) > DLRM_STEP  # resumed from the fixture, not retrained
    return run


def test_old_dlrm_checkpoint_holds_what_today_writes_at_its_step(dlrm_old, dlrm_today):
    today = _newest(dlrm_today)
    assert today["step"] == dlrm_old["step"] == DLRM_STEP
    assert json.loads(dlrm_old["reader"])["row_offset"] == (DLRM_STEP - STEPS_PER_EPOCH) * 128
    assert_close_entries(_comparable(dlrm_old, ()), _comparable(today, ()))


def test_old_dlrm_checkpoint_resumes_exactly_as_todays_with_its_values(
    dlrm_old, dlrm_today, dlrm_resumed, tmp_path
):
    spliced = _spliced(dlrm_today, dlrm_old, tmp_path / "spliced")
    assert train_main(["--resume", str(spliced), "--set", "train.steps=0"]) == 0
    assert_same_run(spliced, dlrm_resumed)


def test_old_dlrm_checkpoint_resumed_ends_near_the_uninterrupted_run(dlrm_resumed, full_run):  # noqa: F811
    assert_close_entries(_metrics(full_run), _metrics(dlrm_resumed))
    assert _metrics(dlrm_resumed)["steps"] == 2 * STEPS_PER_EPOCH
    assert_close_entries(_comparable(_newest(full_run), ()), _comparable(_newest(dlrm_resumed), ()))


# Meta-DLRM -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta_data(tmp_path_factory) -> Path:
    """The task-grouped ratings under ``tasks/{train,test}/grouped``, as the fixture's config names them."""
    root = tmp_path_factory.mktemp("meta_data")
    write_ratings(root / "tasks" / "train", range(0, 48), 0)
    write_ratings(root / "tasks" / "test", range(48, 64), 1)
    return root


def _meta_run(data: Path, out: Path, *extra: str) -> Path:
    tasks = data / "tasks"
    assert train_main(meta_sets(tasks / "train" / "grouped", tasks / "test" / "grouped", out, *extra)) == 0
    return out


@pytest.fixture(scope="module")
def meta_old() -> dict[str, Any]:
    return torch.load(FIXTURES / "meta" / "checkpoints" / f"step-{META_STEP:09d}.pt", weights_only=True)


@pytest.fixture(scope="module")
def meta_today(meta_data, tmp_path_factory) -> Path:
    return _meta_run(meta_data, tmp_path_factory.mktemp("meta_today") / "run", f"train.steps={META_STEP}")


@pytest.fixture(scope="module")
def meta_resumed(meta_data, tmp_path_factory) -> Path:
    run = _unpack("meta", meta_data, tmp_path_factory.mktemp("meta_old") / "meta")
    assert train_main(["--resume", str(run), "--set", "train.steps=0"]) == 0
    assert _first_trained_step(run) > META_STEP
    return run


def test_old_meta_checkpoint_holds_what_today_writes_at_its_step(meta_old, meta_today):
    today = _newest(meta_today)
    assert today["step"] == meta_old["step"] == META_STEP
    assert_close_entries(_comparable(meta_old, META_MEASURED), _comparable(today, META_MEASURED))


def test_old_meta_checkpoint_resumes_exactly_as_todays_with_its_values(
    meta_old, meta_today, meta_resumed, tmp_path
):
    spliced = _spliced(meta_today, meta_old, tmp_path / "spliced")
    assert train_main(["--resume", str(spliced), "--set", "train.steps=0"]) == 0
    assert_same_run(spliced, meta_resumed, measured=META_MEASURED)


def test_old_meta_checkpoint_resumed_ends_near_the_uninterrupted_run(meta_data, meta_resumed, tmp_path):
    full = _meta_run(meta_data, tmp_path / "full")
    assert_close_entries(_metrics(full, META_MEASURED), _metrics(meta_resumed, META_MEASURED))
    assert_close_entries(
        _comparable(_newest(full), META_MEASURED),
        _comparable(_newest(meta_resumed), META_MEASURED),
    )
