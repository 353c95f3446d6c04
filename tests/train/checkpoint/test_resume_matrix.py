"""Resume matrix: a run interrupted anywhere and resumed equals the uninterrupted run.

Interrupted mid-epoch, at an epoch's last step, at the last step and before the first
checkpoint; DLRM, meta-DLRM and hybrid (2 gloo processes). Every tensor and counter of
the final checkpoint and every key of metrics.json (timings aside) must be equal.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from recaccel.cli import train_main
from recaccel.train.checkpoint.state import list_checkpoints
from tests.helpers.resume import (
    STEPS_PER_EPOCH,
    TIMING_KEYS,
    assert_same_entries,
    assert_same_run,
    meta_sets,
    small_sets,
)

pytestmark = pytest.mark.numeric


@pytest.mark.parametrize(
    "stop",
    [
        STEPS_PER_EPOCH // 2,  # mid-epoch
        STEPS_PER_EPOCH,  # an epoch's last step
        2 * STEPS_PER_EPOCH,  # the last step: its checkpoint is written, evaluation is not
    ],
)
def test_dlrm_resumed_after_steps_equals_uninterrupted(small_data, full_run, tmp_path, stop):
    part = tmp_path / "part"
    assert (
        train_main(
            small_sets(small_data, part, f"train.checkpoint_every={STEPS_PER_EPOCH}", f"train.steps={stop}")
        )
        == 0
    )
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    assert_same_run(full_run, part)


@pytest.mark.parametrize("keep", [1, 0])  # the epoch-end checkpoint; none (stopped before the first)
def test_dlrm_resumed_from_older_checkpoints_equals_uninterrupted(full_run, tmp_path, keep):
    """The issue's repro: checkpoints at each epoch's end, the newest deleted, resumed."""
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    (run / "metrics.json").unlink()
    for path in list_checkpoints(run)[keep:]:
        path.unlink()
    assert [int(p.stem.split("-")[1]) for p in list_checkpoints(run)] == [STEPS_PER_EPOCH][:keep]
    assert train_main(["--resume", str(run)]) == 0
    assert_same_run(full_run, run)
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    # The log keeps what came before the checkpoint resumed from, then the resumed steps:
    # each step once (no epoch trained twice), and one final event (the old run's dropped).
    trained = [(e["step"], e["epoch"]) for e in events if e["event"] == "train"]
    logged = [1, *range(5, 2 * STEPS_PER_EPOCH + 1, 5)]
    assert trained == [(s, (s - 1) // STEPS_PER_EPOCH) for s in logged]
    assert [e["event"] for e in events].count("final") == 1 and events[-1]["event"] == "final"


def test_meta_resumed_anywhere_equals_uninterrupted(task_data, tmp_path):  # noqa: F811
    train, test = task_data
    full = tmp_path / "full"
    assert train_main(meta_sets(train, test, full)) == 0
    steps = json.loads((full / "metrics.json").read_text())["steps"]
    per_epoch = steps // 2
    assert per_epoch >= 3
    # Mid-epoch, an epoch's last step, the last step; then a run stopped before its first
    # checkpoint (only its config and log were written).
    for stop in (per_epoch // 2 + 1, per_epoch, steps, 0):
        part = tmp_path / f"part{stop}"
        if stop:
            assert train_main(meta_sets(train, test, part, f"train.steps={stop}")) == 0
            assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
        else:
            shutil.copytree(full, part)
            (part / "metrics.json").unlink()
            for path in list_checkpoints(part):
                path.unlink()
            assert train_main(["--resume", str(part)]) == 0
        # The task reader's decode work and memory high-water mark depend on when its
        # worker threads ran (a resumed window may decode a row group again): they vary
        # from run to run, resumed or not. Every count of rows, tasks and batches is exact.
        assert_same_run(full, part, measured=("max_buffered_rows", "rows_read", "row_groups_read"))


def test_hybrid_resumed_at_epoch_end_equals_uninterrupted(small_data, tmp_path):
    """Two gloo ranks through ``--nproc 2``, stopped at an epoch's last step (the DCP
    checkpoint there) and resumed; compared with the uninterrupted hybrid run."""
    pytest.importorskip("torchrec", exc_type=ImportError)
    hybrid = [
        "parallel.mode=hybrid",
        "parallel.sharding=row_wise",
        "optim.sparse=rowwise_adagrad",
        "train.log_every=4",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main([*small_sets(small_data, full, *hybrid), "--nproc", "2"]) == 0
    assert (
        train_main([*small_sets(small_data, part, *hybrid, f"train.steps={STEPS_PER_EPOCH}"), "--nproc", "2"])
        == 0
    )
    assert train_main(["--resume", str(part), "--set", "train.steps=0", "--nproc", "2"]) == 0
    a = json.loads((full / "metrics.json").read_text())
    b = json.loads((part / "metrics.json").read_text())
    for key in TIMING_KEYS:
        a.pop(key), b.pop(key)
    assert a == b and a["steps"] == 2 * STEPS_PER_EPOCH and a["train_loss"] is not None
    assert_same_entries(_final_dcp(full), _final_dcp(part))
    assert _final_dcp(part)["ranks.1"]["epoch"] == 2


def _final_dcp(run: Path) -> dict[str, Any]:
    """A hybrid run's newest DCP checkpoint as one dict (shards joined, blobs unpickled)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from recaccel.train.distributed.dist_checkpoint import list_sharded_checkpoints

    flat = run / "final.pt"
    dcp_to_torch_save(list_sharded_checkpoints(run)[-1], flat)
    entries = torch.load(flat, weights_only=True)
    return {
        k: torch.load(io.BytesIO(v), weights_only=True) if isinstance(v, bytes) else v
        for k, v in entries.items()
    }
