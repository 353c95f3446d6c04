"""``--overwrite`` deletes only what recaccel wrote into the run directory; a user's files
(and the run lock) stay."""

from __future__ import annotations

import json
from pathlib import Path

from recaccel.cli import train_main
from recaccel.train.checkpoint.state import list_checkpoints
from recaccel.train.run.run_lock import LOCK_FILE
from recaccel.train.run.runlog import check_run_dir, clear_run, run_files
from tests.helpers.dlrm_run import overrides, set_args

RECACCEL_FILES = [
    "config.toml",
    "log.jsonl",
    "log.jsonl.tmp",
    "metrics.json",
    "eval-4.json",
    ".eval-4.1234.tmp.json",
    "checkpoints/step-000000004.pt",
    "checkpoints/step-000000004.pt.sha256",
    "checkpoints/step-000000006.tmp",
    "checkpoints/step-000000008.dcp/recaccel.json",
    "checkpoints/step-000000008.dcp/__0_0.distcp",
    "checkpoints/.step-000000010.dcp.partial/__0_0.distcp",
    "tensorboard/events.out.tfevents.1700000000.host.1.0",
]
USER_FILES = [
    "notes.md",
    "eval-best.json",
    "config.toml.bak",
    "plots/loss.png",
    "checkpoints/notes.txt",
    "checkpoints/best/model.pt",
    "tensorboard/README",
]


def _populate(run: Path, names: list[str]) -> None:
    for name in names:
        path = run / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)


def _files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}


def test_clear_run_deletes_recaccel_files_and_keeps_the_users(tmp_path):
    _populate(tmp_path, RECACCEL_FILES + USER_FILES + [LOCK_FILE])
    deleted = clear_run(tmp_path)
    assert _files(tmp_path) == set(USER_FILES) | {LOCK_FILE}
    assert {p.name for p in deleted} >= {"step-000000008.dcp", ".step-000000010.dcp.partial", "eval-4.json"}
    assert (tmp_path / "notes.md").read_text() == "notes.md"  # untouched, not rewritten


def test_clear_run_removes_its_folders_only_when_left_empty(tmp_path):
    _populate(tmp_path, RECACCEL_FILES + [LOCK_FILE])
    clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]


def test_clear_run_deletes_a_link_not_what_it_points_to(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere.pt"
    elsewhere.write_text("keep")
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-000000002.pt").symlink_to(elsewhere)
    clear_run(run)
    assert elsewhere.read_text() == "keep" and not (run / "checkpoints").exists()


def test_only_user_files_and_a_lock_are_not_a_run(tmp_path):
    _populate(tmp_path, USER_FILES + [LOCK_FILE])
    assert run_files(tmp_path) == []
    check_run_dir(tmp_path, overwrite=False)  # a new run may start here


def test_run_files_name_what_a_refusal_lists(tmp_path):
    _populate(tmp_path, ["log.jsonl", "eval-3.json", "checkpoints/step-000000003.pt", "tensorboard/x.txt"])
    assert run_files(tmp_path) == ["eval-3.json", "log.jsonl", "checkpoints"]


def test_overwrite_from_the_cli_keeps_a_users_notes_and_drops_old_evaluations(tiny_data, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    argv = set_args(overrides(tiny_data, run, "train.steps=4", "train.checkpoint_every=2"))
    assert train_main(argv) == 0
    _populate(run, ["checkpoints/notes.txt", "notes.md", "eval-4.json"])
    capsys.readouterr()
    assert train_main(argv) == 2  # still refused without --overwrite, in one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a run" in err and "--overwrite" in err

    short = set_args(overrides(tiny_data, run, "train.steps=3", "train.checkpoint_every=2"))
    assert train_main([*short, "--overwrite"]) == 0
    assert (run / "checkpoints" / "notes.txt").read_text() == "checkpoints/notes.txt"
    assert (run / "notes.md").read_text() == "notes.md"
    assert not (run / "eval-4.json").exists()
    assert [p.name for p in list_checkpoints(run)] == ["step-000000002.pt", "step-000000003.pt"]
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["train", "final"] and events[-1]["steps"] == 3
