"""SIGTERM / SIGINT stop a run gracefully: the step finishes, its checkpoint is saved, the
log says so, the command exits 143 / 130 with one line; a resume equals the run never stopped.

Each run is a real ``python -m recaccel.cli`` subprocess on the resume matrix's tiny data,
signalled once its log shows training has begun.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recaccel.cli import train_main
from recaccel.train.checkpoint.state import list_checkpoints
from recaccel.train.loop.preemption import Preempted, StopSignals, log_mark, pending_signal, stop_in_log
from recaccel.train.run.runlog import read_events
from tests.helpers.resume import STEPS_PER_EPOCH, assert_same_run, small_sets

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 120.0
EPOCHS = 4  # long enough that a signal sent at the first logged step lands mid-run
RUN = ("train.log_every=1", f"train.epochs={EPOCHS}")
STOPPED = re.compile(
    r"^recaccel-train: stopped by (SIGTERM|SIGINT) at step (\d+); checkpoint saved \(resume with --resume (.+)\)$"
)


def _cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "recaccel.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_training(proc: subprocess.Popen, run: Path) -> None:
    """Returns once the run's log holds its first train event."""
    log = run / "log.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        if log.is_file() and '"event": "train"' in log.read_text():
            return
        time.sleep(0.002)
    raise AssertionError(f"{run} never logged a training step")


def _stopped_run(data: Path, run: Path, sig: signal.Signals) -> tuple[int, str, int]:
    """Starts a run, sends ``sig`` once it trains; returns (exit status, stderr, stop step)."""
    proc = _cli(*small_sets(data, run, *RUN))
    _wait_for_training(proc, run)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    lines = err.strip().splitlines()
    match = STOPPED.match(lines[-1]) if lines else None
    assert match, err[-2000:]
    assert match.group(1) == sig.name and match.group(3) == str(run)
    return proc.returncode, err, int(match.group(2))


def _assert_clean_stop(run: Path, sig: signal.Signals, step: int) -> None:
    """The newest checkpoint is the stop step's, no temporary file is left, and the log
    ends with the ``stopped`` event."""
    assert 1 <= step < EPOCHS * STEPS_PER_EPOCH  # stopped mid-run, after a whole step
    checkpoints = list_checkpoints(run)
    assert checkpoints[-1].name == f"step-{step:09d}.pt"
    assert torch.load(checkpoints[-1], weights_only=True)["step"] == step
    assert not list((run / "checkpoints").glob("*.tmp"))
    last = read_events(run)[-1]
    assert (last["event"], last["signal"], last["step"]) == ("stopped", sig.name, step)
    assert not (run / "metrics.json").exists()


@pytest.fixture(scope="module")
def uninterrupted(small_data, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("preempt") / "full"
    assert train_main(small_sets(small_data, out, *RUN)) == 0
    return out


def test_sigterm_finishes_the_step_saves_a_checkpoint_and_exits_143(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    status, _, step = _stopped_run(small_data, run, signal.SIGTERM)
    assert status == 143
    _assert_clean_stop(run, signal.SIGTERM, step)


def test_sigint_exits_130_with_a_checkpoint(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    status, err, step = _stopped_run(small_data, run, signal.SIGINT)
    assert status == 130
    assert "Traceback" not in err
    _assert_clean_stop(run, signal.SIGINT, step)


def test_resume_after_sigterm_is_bit_identical(small_data, uninterrupted, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    status, _, step = _stopped_run(small_data, run, signal.SIGTERM)
    assert status == 143
    assert train_main(["--resume", str(run)]) == 0
    assert [e["step"] for e in read_events(run) if e["event"] == "stopped"] == [step]
    assert_same_run(uninterrupted, run)  # parameters (torch.equal), counters, AUC, logloss


def test_second_signal_exits_at_once(tmp_path):
    # A process stopping (the handler recorded the first SIGTERM) and busy for a minute:
    # the second SIGTERM must end it at once, killed by the signal.
    script = (
        "import time\n"
        "from recaccel.train.loop.preemption import StopSignals\n"
        "with StopSignals() as stop:\n"
        "    print('ready', flush=True)\n"
        "    while stop.pending is None: time.sleep(0.001)\n"
        "    print('stopping', flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "stopping\n"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert time.monotonic() - started < 5


def test_handlers_are_restored_when_fit_ends_or_fails():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(RuntimeError, match="failed"), StopSignals():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        assert pending_signal() is None
        raise RuntimeError("training failed")
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert pending_signal() is None


def test_preempted_is_not_an_exception_and_names_its_exit_status(tmp_path):
    stop = Preempted("SIGTERM", 7, tmp_path)
    assert isinstance(stop, KeyboardInterrupt) and not isinstance(stop, Exception)
    assert stop.exit_status == 143 and Preempted("SIGINT", 7, tmp_path).exit_status == 130
    assert str(stop) == f"stopped by SIGTERM at step 7; checkpoint saved (resume with --resume {tmp_path})"


def test_stop_in_log_reads_only_events_after_the_mark(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"event": "stopped", "signal": "SIGINT", "step": 3}) + "\n")
    mark = log_mark(tmp_path)
    assert stop_in_log(tmp_path, mark) is None  # an earlier launch's stop
    with open(log, "a") as f:
        f.write(json.dumps({"event": "train", "step": 5}) + "\n")
        f.write(json.dumps({"event": "stopped", "signal": "SIGTERM", "step": 6}) + "\n")
        f.write('{"event": "tor')  # a torn last line
    stop = stop_in_log(tmp_path, mark)
    assert (stop.signal_name, stop.step, stop.run_dir) == ("SIGTERM", 6, str(tmp_path))


def test_stop_in_log_reads_a_log_made_anew_whole(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"event": "train", "step": 1}) * 20 + "\n")
    mark = log_mark(tmp_path)
    kept = tmp_path / "kept"
    log.rename(kept)  # --overwrite: the old log goes, a new one starts (kept: a new inode)
    log.write_text(json.dumps({"event": "stopped", "signal": "SIGINT", "step": 2}) + "\n")
    assert stop_in_log(tmp_path, mark).step == 2


HYBRID = (
    "parallel.mode=hybrid",
    "parallel.sharding=row_wise",
    "optim.sparse=rowwise_adagrad",
)


def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step(small_data, tmp_path):  # noqa: F811
    # torchrun's agent forwards the signal to both ranks; they agree on the stop, write
    # that step's sharded checkpoint together, and the launcher exits 143 with one line.
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.train.checkpoint.paths import list_sharded_checkpoints

    run = tmp_path / "run"
    proc = _cli(*small_sets(small_data, run, *RUN, *HYBRID), "--nproc", "2")
    _wait_for_training(proc, run)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 143, err[-2000:]
    stops = [m for m in map(STOPPED.match, err.splitlines()) if m]
    assert len(stops) == 1 and stops[0].group(1) == "SIGTERM", err[-2000:]
    step = int(stops[0].group(2))
    assert 1 <= step < EPOCHS * STEPS_PER_EPOCH
    newest = list_sharded_checkpoints(run)[-1]
    info = json.loads((newest / "recaccel.json").read_text())
    assert newest.name == f"step-{step:09d}.dcp" and (info["step"], info["world_size"]) == (step, 2)
    assert not list((run / "checkpoints").glob(".*.partial"))
    last = read_events(run)[-1]
    assert (last["event"], last["signal"], last["step"]) == ("stopped", "SIGTERM", step)


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of ``rank`` among the launcher's children (read from /proc)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = (entry / "environ").read_bytes().split(b"\0") if parent == launcher else []
            except (OSError, ValueError, IndexError):
                continue
            if f"RANK={rank}".encode() in env:
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} of launcher {launcher} never started")


def test_a_signalled_rank_does_not_stop_alone(small_data, tmp_path):  # noqa: F811
    # Only rank 1 gets SIGTERM: the per-step agreement tells rank 0, both write the same
    # step's sharded checkpoint, and the launcher still ends with the one line and 143.
    pytest.importorskip("torchrec", exc_type=ImportError)
    if not Path("/proc/self/environ").is_file():
        pytest.skip("finding a rank's pid reads /proc")
    from recaccel.train.checkpoint.paths import list_sharded_checkpoints

    run = tmp_path / "run"
    proc = _cli(*small_sets(small_data, run, *RUN, *HYBRID), "--nproc", "2")
    rank1 = _rank_pid(proc.pid, 1)
    _wait_for_training(proc, run)
    os.kill(rank1, signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 143, err[-2000:]
    stops = [m for m in map(STOPPED.match, err.splitlines()) if m]
    assert len(stops) == 1, err[-2000:]
    step = int(stops[0].group(2))
    newest = list_sharded_checkpoints(run)[-1]
    assert json.loads((newest / "recaccel.json").read_text())["step"] == step
    assert read_events(run)[-1]["event"] == "stopped"
