"""Checkpoints written by an older recaccel resume exactly after a refactor.

``tests/fixtures/checkpoints_2026_11_23`` holds a DLRM run stopped mid-epoch (step 17 of
28) and a meta-DLRM run stopped at step 5, written by commit 89cdcc5 (before the data
package's layout change) on the tiny datasets of ``test_resume_matrix``, which are
regenerated here from their seeds. Each is resumed with today's code and must end equal
to an uninterrupted run of today's code: same model, optimizer, reader position and RNG
streams.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from recaccel.cli import train_main
from tests.train.test_meta_trainer import _ratings
from tests.train.test_resume_matrix import _meta, assert_same_run, full_run, tiny_data  # noqa: F401  (fixtures)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "checkpoints_2026_11_23"


def _unpack(name: str, data_root: Path, run: Path) -> Path:
    """The fixture run copied to ``run``, its config pointed at ``data_root``."""
    shutil.copytree(FIXTURES / name, run)
    config = run / "config.toml"
    config.write_text(
        config.read_text().replace("@DATA@/" + name, str(run)).replace("@DATA@", str(data_root))
    )
    return run


def _first_trained_step(run: Path) -> int:
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return min(e["step"] for e in events if e["event"] == "train")


def test_dlrm_checkpoint_from_before_the_layout_change_resumes_exactly(tiny_data, full_run, tmp_path):  # noqa: F811
    root = tmp_path / "data"
    root.mkdir()
    (root / "synth").symlink_to(tiny_data)
    run = _unpack("dlrm", root, tmp_path / "dlrm")
    assert train_main(["--resume", str(run), "--set", "train.steps=0"]) == 0
    assert _first_trained_step(run) > 17  # resumed from the fixture, not retrained
    assert_same_run(full_run, run)


def test_meta_checkpoint_from_before_the_layout_change_resumes_exactly(tmp_path):
    root = tmp_path / "data"
    train = _ratings(root / "tasks" / "train", range(0, 48), 0)
    test = _ratings(root / "tasks" / "test", range(48, 64), 1)
    full = tmp_path / "full"
    assert train_main(_meta(train, test, full)) == 0
    run = _unpack("meta", root, tmp_path / "meta")
    assert train_main(["--resume", str(run), "--set", "train.steps=0"]) == 0
    assert _first_trained_step(run) > 5
    assert_same_run(full, run, measured=("max_buffered_rows", "rows_read", "row_groups_read"))
