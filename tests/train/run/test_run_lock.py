"""One process per run directory: ``RUN/.lock``, held by train and resume, refuses a second
process in one line naming the holder; a holder killed by SIGKILL leaves nothing that blocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.train.run import run_lock
from recaccel.train.run.run_lock import LOCK_FILE, RunDirInUseError
from tests.helpers.dlrm_run import overrides, set_args

REPO = Path(__file__).resolve().parents[3]
HOLD = (
    "import sys, time\n"
    "from recaccel.train.run.run_lock import acquire\n"
    "acquire(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)
FORK = (
    "import os, sys, time\n"
    "from recaccel.train.run.run_lock import acquire\n"
    "acquire(sys.argv[1])\n"
    "if os.fork() == 0:  # the child speaks once its fork hooks ran\n"
    "    print(os.getpid(), flush=True)\n"
    "    time.sleep(120)\n"
    "    os._exit(0)\n"
    "time.sleep(120)\n"
)
ENTER = (
    "import sys\n"
    "from recaccel.train.run.run_lock import for_training\n"
    "try:\n"
    "    with for_training(sys.argv[1]):\n"
    "        print('entered')\n"
    "except Exception as e:\n"
    "    print(f'refused: {e}')\n"
)


def _python(code: str, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    full_env = dict(env if env is not None else os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _holder(run: Path) -> subprocess.Popen:
    """A real process holding the lock of ``run`` (until killed)."""
    proc = _python(HOLD, str(run))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _snapshot(run: Path) -> dict[str, bytes | None]:
    """Every entry under ``run``: a file's bytes, None for a folder."""
    return {
        str(p.relative_to(run)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(run.rglob("*"))
        if p.name != LOCK_FILE
    }


@pytest.fixture
def finished_run(tiny_data, tmp_path) -> tuple[Path, list[str]]:  # noqa: F811
    run = tmp_path / "run"
    argv = set_args(overrides(tiny_data, run, "train.steps=4", "train.checkpoint_every=2"))
    assert train_main(argv) == 0
    return run, argv


def test_second_train_on_a_locked_run_dir_exits_2_naming_the_holder(finished_run, capsys):
    run, argv = finished_run
    before = _snapshot(run)
    holder = _holder(run)
    try:
        capsys.readouterr()
        for second in ([*argv, "--overwrite"], ["--resume", str(run)], argv):
            assert train_main(second) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            assert err.startswith(
                f"recaccel-train: error: run directory {run} is in use by process {holder.pid} "
                f"(on host {socket.gethostname()}, since "
            ), err
            assert err.rstrip().endswith("); wait for it or use another train.out_dir"), err
        assert _snapshot(run) == before  # nothing of the holder's run was deleted or written
    finally:
        holder.kill()
        holder.wait()


def test_nproc_launcher_on_a_locked_run_dir_exits_2_before_starting_ranks(
    tiny_data,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    from recaccel.train.distributed import launch

    def relaunch(*args, **kwargs):
        raise AssertionError("ranks were launched on a locked run directory")

    monkeypatch.setattr(launch, "relaunch", relaunch)
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        argv = [*set_args(overrides(tiny_data, run, "train.steps=2", "parallel.mode=hybrid")), "--nproc", "2"]
        capsys.readouterr()
        assert train_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is in use by process {holder.pid} " in err, err
        assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_process_killed_by_sigkill_does_not_block(finished_run):
    run, _ = finished_run
    holder = _holder(run)
    holder.send_signal(signal.SIGKILL)
    assert holder.wait() == -signal.SIGKILL
    assert str(holder.pid) in (run / LOCK_FILE).read_text()  # the file stays, the lock is gone
    assert train_main(["--resume", str(run), "--set", "train.steps=6"]) == 0
    assert str(os.getpid()) in (run / LOCK_FILE).read_text()


def test_a_forked_child_outliving_its_killed_parent_does_not_keep_the_lock(tmp_path):
    run = tmp_path / "run"
    parent = _python(FORK, str(run))
    child_pid = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        os.kill(child_pid, 0)  # the child still runs
        with run_lock.locked(run):
            assert run_lock.holds(run)
    finally:
        os.kill(child_pid, signal.SIGKILL)


def test_lock_is_released_when_train_returns(finished_run):
    run, _ = finished_run
    assert train_main(["--resume", str(run)]) == 0
    holder = _holder(run)  # another process gets it at once
    holder.kill()
    holder.wait()


def test_lock_is_reentrant_within_a_process_and_refuses_another(tmp_path):
    run = tmp_path / "run"
    with run_lock.locked(run), run_lock.locked(run):
        assert run_lock.holds(run)
        child = _python(ENTER, str(run))
        out, _ = child.communicate(timeout=60)
        assert out.startswith(f"refused: run directory {run} is in use by process {os.getpid()} "), out
    assert not run_lock.holds(run)


def _rank_env(rank: str) -> dict[str, str]:
    return dict(os.environ, RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank)


def test_ranks_of_a_launcher_holding_the_lock_are_not_blocked(tmp_path):
    """The launcher (this process) holds the lock and lends it: its rank 0 enters; a rank 0
    that was not lent it (a stray torchrun on the same directory) is refused; rank 1 never locks."""
    run = tmp_path / "run"
    with run_lock.locked(run):
        stray = _python(ENTER, str(run), env=_rank_env("0"))
        assert stray.communicate(timeout=60)[0].startswith("refused: run directory")
        with run_lock.lend_to_ranks(run):
            lent = [_python(ENTER, str(run), env=_rank_env(rank)) for rank in ("0", "1")]
            assert [p.communicate(timeout=60)[0].strip() for p in lent] == ["entered", "entered"]
        assert "RECACCEL_RUN_LOCK_DIR" not in os.environ  # lent for the block only
        rank1 = _python(ENTER, str(run), env=_rank_env("1"))
        assert rank1.communicate(timeout=60)[0].strip() == "entered"


def test_lending_a_lock_this_process_does_not_hold_is_refused(tmp_path):
    from recaccel.errors import RecaccelError

    with pytest.raises(RecaccelError, match="not locked by this process"), run_lock.lend_to_ranks(tmp_path):
        pass


def test_api_train_is_refused_while_another_process_holds_the_run(tiny_data, tmp_path):  # noqa: F811
    import recaccel.api as api

    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(RunDirInUseError, match=f"in use by process {holder.pid} "):
            api.train(load_config(None, overrides(tiny_data, run, "train.steps=2")))
        assert [p.name for p in run.iterdir()] == [LOCK_FILE]  # nothing was written
    finally:
        holder.kill()
        holder.wait()
