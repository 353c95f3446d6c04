"""Reader worker processes live across epochs: the same processes serve every epoch of a
reader, an abandoned iteration stops them, and a Ctrl-C at any moment (while they start,
between epochs, mid-epoch) ends the program without hanging or leaving anything behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recaccel.io.readers.interrupts import sigint_deferred
from tests.helpers.reader_processes import (
    alive,
    our_segments,
    reader_workers,
    rows_reader,
    task_reader,
    wait_gone,
    wait_reaped,
)
from tests.helpers.same_batches import assert_same_batches

ROOT = Path(__file__).resolve().parents[2]


def epochs_with_pids(reader, epochs: int) -> tuple[list[list], list[list[int]]]:
    """Each epoch's batches, and the reader's worker pids seen during it (those of
    readers an earlier test left to the garbage collector excluded)."""
    gc.collect()
    others = set(reader_workers())
    batches, pids = [], []
    for _ in range(epochs):
        epoch = []
        for batch in reader:
            if not epoch:
                pids.append(sorted(set(reader_workers()) - others))
            epoch.append(batch)
        batches.append(epoch)
    return batches, pids


@pytest.mark.parametrize("make", [rows_reader, task_reader], ids=["batch_reader", "task_reader"])
def test_the_same_worker_processes_serve_every_epoch_and_batches_match_0_workers(make, request):
    path = request.getfixturevalue("worker_rows_data" if make is rows_reader else "worker_task_data")
    want, _ = epochs_with_pids(make(path, 0), 3)
    reader = make(path, 2)
    got, pids = epochs_with_pids(reader, 3)
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2]
    for a, b in zip(want, got, strict=True):
        assert_same_batches(a, b)
    assert all(alive(p) for p in pids[0]) and our_segments() != []  # idle between epochs
    del reader
    gc.collect()
    assert wait_gone(pids[0]) and our_segments() == []


def test_a_break_mid_epoch_stops_the_workers_and_the_next_iteration_resumes_with_new_ones(worker_rows_data):
    want = list(rows_reader(worker_rows_data, 0))
    gc.collect()
    others = set(reader_workers())
    reader = rows_reader(worker_rows_data, 2)
    it = iter(reader)
    head = [next(it) for _ in range(5)]
    first = sorted(set(reader_workers()) - others)
    it.close()  # items still in flight: the pool is closed, not reused
    assert wait_gone(first) and our_segments() == []
    rest = list(reader)
    assert_same_batches(want, head + rest)
    second = sorted(set(reader_workers()) - others)
    assert len(first) == len(second) == 2 and not set(first) & set(second)
    del reader, it
    gc.collect()
    assert wait_gone(second) and our_segments() == []


def test_a_worker_that_died_between_epochs_is_replaced_and_the_next_epoch_is_the_same(
    worker_rows_data, caplog
):
    base = rows_reader(worker_rows_data, 0)
    want = [list(base) for _ in range(2)]
    gc.collect()
    others = set(reader_workers())
    reader = rows_reader(worker_rows_data, 2)
    assert_same_batches(want[0], list(reader))
    dead = sorted(set(reader_workers()) - others)
    assert len(dead) == 2
    os.kill(dead[0], signal.SIGKILL)
    assert wait_reaped(dead[:1])  # its pipe reads EOF only once all its threads are gone
    assert_same_batches(want[1], list(reader))
    assert len(set(reader_workers()) - others - set(dead)) == 2  # a new pool
    assert f"reader worker(s) [{dead[0]}] died between iterations" in caplog.text
    assert wait_gone(dead)  # the pool with the dead worker was stopped whole
    del reader
    gc.collect()
    assert our_segments() == []


def test_a_ctrl_c_inside_a_deferred_block_is_raised_after_it_under_the_previous_handler():
    # Python's own handler, whatever this process inherited (a shell's background job
    # starts with SIGINT ignored, and then a deferred Ctrl-C is rightly ignored too).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _check_deferred_ctrl_c()
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_ctrl_c_inside_a_deferred_block_stays_ignored_where_it_was_ignored():
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


def _check_deferred_ctrl_c() -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the signal is handled meanwhile: recorded, not raised
            steps.append("finished")
    assert steps == ["finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: calls.append(signum))
    try:
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert calls == []
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


STRESS_SCRIPT = textwrap.dedent(
    """
    import faulthandler, gc, glob, os, random, signal, sys, threading, time
    import multiprocessing as mp
    from pathlib import Path
    from recaccel.io.readers import BatchReader, ReadOptions

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    def trial(path, delay, last):
        # Iterates epochs until a Ctrl-C sent after `delay` seconds ends it; the last one
        # lets the KeyboardInterrupt end the program.
        reader = BatchReader(path, 4, ReadOptions(seed=1, workers=2), shuffle_buffer_rows=25)
        seen = set()
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            while True:
                for _ in reader:
                    new = {p.pid for p in mp.active_children() if p.name.startswith("reader-worker")} - seen
                    if new:
                        print("pids", *new, flush=True)
                        seen |= new
        except KeyboardInterrupt:
            if last:
                raise
        finally:
            timer.cancel()
            timer.join()
        del reader
        gc.collect()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(alive(p) for p in seen), seen
        assert glob.glob(f"/dev/shm/rca{os.getpid()}x*") == []
        print("ok", flush=True)

    if __name__ == "__main__":
        path, trials, window, seed = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
        rng = random.Random(seed)
        for t in range(trials):
            faulthandler.dump_traceback_later(20, exit=True)  # a hang: its stack, exit status 1
            # From 0 (before the first worker starts) to several epochs in.
            trial(path, rng.uniform(0, window), t == trials - 1)
    """
)


def run_stress(data: Path, script: Path, trials: int, window: float, seed: int) -> tuple[int, str, int]:
    """(exit status, stdout + stderr, pid) of the stress script."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(script), str(data), str(trials), str(window), str(seed)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        output, _ = proc.communicate(timeout=30 * trials)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, output, proc.pid


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
def test_ctrl_c_at_random_moments_never_hangs_and_leaves_no_workers_or_shared_memory(
    worker_rows_data, tmp_path
):
    script = tmp_path / "stress.py"
    script.write_text(STRESS_SCRIPT)
    trials = 16
    # 0.6 s covers the forkserver's and the first workers' start and several epoch
    # boundaries (an epoch here takes a few tens of milliseconds).
    status, output, pid = run_stress(worker_rows_data, script, trials, 0.6, seed=7)
    # Python ends on an uncaught KeyboardInterrupt by killing itself with SIGINT.
    assert status == -signal.SIGINT, output[-3000:]
    assert output.splitlines().count("ok") == trials - 1, output[-3000:]
    pids = [int(p) for line in output.splitlines() if line.startswith("pids ") for p in line.split()[1:]]
    assert wait_gone(pids)
    assert list(Path("/dev/shm").glob(f"rca{pid}x*")) == []
