"""log.jsonl after a resume holds each step once: what was logged past the checkpoint the
run resumes from (and a torn last line) is dropped; a new event never continues a torn line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from recaccel.cli import train_main
from recaccel.train.checkpoint.state import list_checkpoints
from recaccel.train.run.runlog import LOG_FILE, RunLog, read_events, trim_log
from tests.helpers.dlrm_run import overrides, set_args

REPO = Path(__file__).resolve().parents[3]


def _write(path: Path, events: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)


def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_trim_keeps_events_up_to_the_resume_step_and_drops_the_rest(tmp_path):
    log = tmp_path / LOG_FILE
    kept = [
        {"event": "train", "step": 1},
        {"event": "note"},  # no step, logged before the abandoned stretch: kept
        {"event": "train", "step": 4},
        {"event": "eval", "step": 4},
        {"event": "monitor", "step": 4},
    ]
    dropped = [
        {"event": "train", "step": 5},
        {"event": "straggler", "step": 6},
        {"event": "note"},  # no step, inside the abandoned stretch
        {"event": "final", "steps": 6},
    ]
    _write(log, kept + dropped, tail='{"event": "train", "st')
    assert trim_log(log, 4)
    assert _lines(log) == kept
    assert not trim_log(log, 4)  # nothing more to drop: the file is left alone
    assert not (tmp_path / "log.jsonl.tmp").exists()


def test_trim_drops_a_finished_runs_final_event_resumed_at_its_last_step(tmp_path):
    log = tmp_path / LOG_FILE
    _write(
        log, [{"event": "train", "step": 1}, {"event": "train", "step": 6}, {"event": "final", "steps": 6}]
    )
    trim_log(log, 6)
    assert _lines(log) == [{"event": "train", "step": 1}, {"event": "train", "step": 6}]


def test_resumed_log_drops_a_torn_last_line_before_the_next_event(tmp_path):
    _write(tmp_path / LOG_FILE, [{"event": "train", "step": 1}], tail='{"event": "train", "step": 2, "lo')
    log = RunLog(tmp_path, resumed_at=1)
    log.event("train", step=2)
    log.close()
    assert [(e["event"], e["step"]) for e in _lines(tmp_path / LOG_FILE)] == [("train", 1), ("train", 2)]


def test_appending_log_starts_a_new_line_after_a_torn_one(tmp_path):
    _write(tmp_path / LOG_FILE, [{"event": "train", "step": 1}], tail='{"event": "tr')
    log = RunLog(tmp_path)
    log.event("eval", step=1)
    log.close()
    lines = (tmp_path / LOG_FILE).read_text().splitlines()
    assert lines[1] == '{"event": "tr' and json.loads(lines[2])["event"] == "eval"  # not glued on
    assert [e["event"] for e in read_events(tmp_path)] == ["train", "eval"]


def _killed_at_step_7(data: Path, run: Path) -> None:
    """A real run, checkpointed at step 4, that logged steps 5 and 6 and died after step 7."""
    sets = overrides(
        data,
        run,
        "train.steps=10",
        "train.checkpoint_every=4",
        "train.log_every=1",
        "fault.kill_rank_at_step=7",
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "recaccel.cli", *set_args(sets)],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 17, done.stderr  # fault.kill_rank_at_step: os._exit(17)


def test_run_killed_after_logging_past_its_checkpoint_logs_each_step_once_after_resume(tiny_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    _killed_at_step_7(tiny_data, run)
    assert [p.name for p in list_checkpoints(run)] == ["step-000000004.pt"]
    assert [e["step"] for e in read_events(run) if e["event"] == "train"] == [1, 2, 3, 4, 5, 6]
    with open(run / LOG_FILE, "a") as f:
        f.write('{"event": "train", "step": 7, "lo')  # a write cut short as well
    assert train_main(["--resume", str(run), "--set", "fault.kill_rank_at_step=0"]) == 0
    events = _lines(run / LOG_FILE)
    assert [e["step"] for e in events if e["event"] == "train"] == list(range(1, 11))
    assert [e["event"] for e in events].count("final") == 1 and events[-1]["event"] == "final"


def test_finished_run_resumed_for_more_steps_has_one_final_event(tiny_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert train_main(set_args(overrides(tiny_data, run, "train.steps=4", "train.checkpoint_every=2"))) == 0
    assert train_main(["--resume", str(run), "--set", "train.steps=7"]) == 0
    events = _lines(run / LOG_FILE)
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 5]  # log_every=5: step 1 and 5
    finals = [e for e in events if e["event"] == "final"]
    assert len(finals) == 1 and finals[0]["steps"] == 7
