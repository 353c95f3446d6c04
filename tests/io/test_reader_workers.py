"""Reader worker processes (``data.workers``): the same batches, order and resume for every
worker count, worker deaths as one error line, and no processes or shared memory left."""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from recaccel.config import DataConfig, load_config
from recaccel.errors import ConfigError
from recaccel.io.convert.synth import generate_synthetic
from recaccel.io.format.decode import Policies
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers import BatchReader, ReadOptions, Shard, TaskReader
from recaccel.io.readers.processes import ProcessLoader, ReaderWorkerError
from recaccel.io.readers.shm_ring import SlotReader, SlotWriter
from tests.helpers.reader_processes import alive, our_segments, reader_workers, rows_reader, task_reader
from tests.helpers.row_data import make_columns, make_schema, skipping_dataset, small_dataset
from tests.helpers.same_batches import assert_same_batches
from tests.helpers.task_data import tasks_config

ROOT = Path(__file__).resolve().parents[2]
# Decode counters of the task reader count row groups decoded again to complete a task,
# which depends on which units share a process (as it depends on read_ahead threads).
TASK_DECODE_COUNTERS = ("rows_read", "row_groups_read", "max_buffered_rows")


def without(state: dict, counters: tuple[str, ...]) -> dict:
    return {**state, "counters": {k: v for k, v in state["counters"].items() if k not in counters}}


def test_shared_memory_round_trip_keeps_dtypes_shapes_order_and_none():
    value = {
        "f": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "i": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "b": torch.tensor([True, False]),
        "e": np.zeros((0, 5), np.int64),
        "n": None,
        "t": (1, "x", [np.float32(2.5)]),
    }
    writer, reader = SlotWriter(f"rca{os.getpid()}xtest", 1), SlotReader()
    try:
        out = reader.read(writer.write(0, value))
        again = reader.read(writer.write(0, {**value, "f": torch.ones(40, 40)}))  # grows the slot
    finally:
        reader.close()
        writer.close()
    assert torch.equal(out["f"], value["f"]) and out["f"].dtype == torch.bfloat16
    assert np.array_equal(out["i"], value["i"]) and out["i"].dtype == np.int32 and out["i"].flags.f_contiguous
    assert torch.equal(out["b"], value["b"]) and out["e"].shape == (0, 5)
    assert out["n"] is None and out["t"] == (1, "x", [np.float32(2.5)])
    assert torch.equal(again["f"], torch.ones(40, 40))
    assert our_segments() == []


@pytest.fixture(scope="module")
def skipping_data(tmp_path_factory) -> Path:
    """Rows with ids past their table here and there: under ``skip`` buffers hold fewer
    rows than their footers say, so the rows carried between buffers shift."""
    return skipping_dataset(tmp_path_factory.mktemp("skips"))


@pytest.mark.parametrize(
    ("data", "options"),
    [
        ("worker_rows_data", {}),
        ("worker_rows_data", {"shuffle": False, "drop_last": True}),
        ("skipping_data", {"policies": Policies(invalid_ids="skip")}),
    ],
)
def test_batch_streams_and_states_are_identical_for_0_to_3_workers(data, options, request):
    path = request.getfixturevalue(data)

    def run(workers: int) -> list:
        opts = ReadOptions(seed=3, workers=workers, **options)
        return list(BatchReader(path, 16, opts, shuffle_buffer_rows=40).iter_with_state())

    runs = {n: run(n) for n in (0, 1, 2, 3)}
    base = runs[0]
    for n in (1, 2, 3):
        assert_same_batches([b for b, _ in base], [b for b, _ in runs[n]])
        # max_buffered_rows counts the buffers decoded ahead: max(read_ahead, workers) of them.
        same = () if n <= 2 else ("max_buffered_rows",)
        assert [without(s, same) for _, s in runs[n]] == [without(s, same) for _, s in base]
    if "policies" in options:
        assert base[-1][1]["counters"]["rows_skipped"] == 23
    assert our_segments() == []


def test_task_batch_streams_are_identical_for_0_to_3_workers(worker_task_data):
    runs = {n: list(task_reader(worker_task_data, n).iter_with_state()) for n in (0, 1, 2, 3)}
    base = runs[0]
    for n in (1, 2, 3):
        assert_same_batches([b for b, _ in base], [b for b, _ in runs[n]])
        want = [without(s, TASK_DECODE_COUNTERS) for _, s in base]
        assert [without(s, TASK_DECODE_COUNTERS) for _, s in runs[n]] == want


@pytest.mark.parametrize(("before", "after"), [(2, 0), (0, 3), (3, 1)])
def test_resume_mid_epoch_with_another_worker_count_yields_the_same_rest(worker_rows_data, before, after):
    full = list(rows_reader(worker_rows_data, 0))
    first = rows_reader(worker_rows_data, before)
    it = first.iter_with_state()
    for _ in range(7):
        _, state = next(it)
    it.close()
    resumed = rows_reader(worker_rows_data, after)
    resumed.load_state_dict(state)
    assert_same_batches(full[7:], list(resumed))


def test_task_reader_resumes_mid_epoch_with_another_worker_count(worker_task_data):
    full = list(task_reader(worker_task_data, 0))
    it = task_reader(worker_task_data, 2).iter_with_state()
    for _ in range(3):
        _, state = next(it)
    it.close()
    resumed = task_reader(worker_task_data, 0)
    resumed.load_state_dict(state)
    assert_same_batches(full[3:], list(resumed))


def test_breaking_out_of_the_loop_stops_the_workers_and_frees_shared_memory(worker_rows_data):
    reader = rows_reader(worker_rows_data, 2)
    it = reader.iter_with_state()
    next(it)
    assert our_segments() != []  # the workers' slots exist while iterating
    it.close()
    assert our_segments() == []
    # Garbage collection of an abandoned loop does the same.
    for _ in zip(range(2), rows_reader(worker_rows_data, 2), strict=False):
        pass
    assert our_segments() == []


def test_a_killed_worker_is_one_error_naming_file_and_row_group_within_seconds(worker_rows_data):
    reader = rows_reader(worker_rows_data, 0)
    buffers = reader.buffers(0)
    job = reader._job(buffers, 0, 0)
    loader = ProcessLoader(job, len(buffers), 0, 2)
    try:
        loader.get(0)
        os.kill(loader.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ReaderWorkerError) as err:
            loader.get(1)
            loader.get(2)
            loader.get(3)
        assert time.monotonic() - started < 10
    finally:
        loader.close()
    message = str(err.value)
    assert "\n" not in message and "died" in message
    assert ".parquet row group " in message
    assert our_segments() == []


def test_a_worker_killed_mid_epoch_stops_the_reader_with_one_line_within_seconds(worker_rows_data):
    it = iter(rows_reader(worker_rows_data, 2))
    next(it)
    pids = reader_workers()
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(ReaderWorkerError) as err:
        for _ in it:
            pass
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert "\n" not in message and f"(pid {pids[0]}) died (exit code -9)" in message
    assert ".parquet row group " in message
    assert our_segments() == [] and not any(alive(p) for p in pids)


def read_until_error(path: Path, workers: int) -> tuple[int, Exception]:
    reader = BatchReader(path, 16, ReadOptions(shuffle=False, workers=workers), shuffle_buffer_rows=25)
    batches = 0
    try:
        for _ in reader:
            batches += 1
    except Exception as exc:  # noqa: BLE001 (compared below)
        return batches, exc
    raise AssertionError("no error")


def test_a_bad_value_in_a_worker_raises_the_in_process_error_at_the_same_batch(tmp_path):
    schema = make_schema(2, [False, True, False], [50, 20, 7])
    cols = make_columns(schema, 100, 0)
    cols[schema.sparse[0].name][80] = 999  # past the cardinality: an error under invalid_ids="error"
    write_parquet(tmp_path, schema, cols, rows_per_row_group=25)
    inline, threaded = read_until_error(tmp_path, 0), read_until_error(tmp_path, 2)
    # Batches are cut one ahead: the 4th waits for the 5th, which needs the bad row group.
    assert threaded[0] == inline[0] == 3
    assert type(threaded[1]) is type(inline[1]) and str(threaded[1]) == str(inline[1])
    assert "\n" not in str(inline[1]) and "row group 3" in str(inline[1])
    assert our_segments() == []


SIGNAL_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import multiprocessing as mp
    from recaccel.io.readers import BatchReader, ReadOptions

    if __name__ == "__main__":
        reader = BatchReader(Path(sys.argv[1]), 4, ReadOptions(seed=1, workers=2), shuffle_buffer_rows=25)
        while True:
            for i, _ in enumerate(reader):
                if i == 0:
                    pids = [p.pid for p in mp.active_children() if p.name.startswith("reader-worker")]
                    print(" ".join(map(str, pids)), flush=True)
    """
)


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
# Python ends on an uncaught KeyboardInterrupt by killing itself with SIGINT.
@pytest.mark.parametrize(
    ("sig", "status"),
    [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)],
)
def test_sigterm_or_ctrl_c_to_a_process_iterating_a_reader_leaves_no_workers_or_shared_memory(
    worker_rows_data, tmp_path, sig, status
):
    script = tmp_path / "iterate.py"
    script.write_text(SIGNAL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(worker_rows_data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.send_signal(sig)
        # A Ctrl-C at random moments, worker starts included: test_reader_worker_pool.py.
        assert proc.wait(timeout=45) == status  # generous: a loaded host
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
        assert glob.glob(f"/dev/shm/rca{proc.pid}x*") == []
    finally:
        proc.kill()
        proc.wait()


def _iterate_in_a_daemon(path: str, out) -> None:
    try:
        list(rows_reader(Path(path), 1))
        out.put("no error")
    except Exception as exc:  # noqa: BLE001 (sent to the test)
        out.put(f"{type(exc).__name__}: {exc}")


def test_workers_inside_a_daemonic_process_are_refused_in_one_line(worker_rows_data):
    ctx = mp.get_context("forkserver")  # the readers' server: recaccel is imported there already
    out = ctx.Queue()
    proc = ctx.Process(target=_iterate_in_a_daemon, args=(str(worker_rows_data), out), daemon=True)
    proc.start()
    message = out.get(timeout=60)
    proc.join(10)
    assert message.startswith("ConfigError: data.workers > 0 cannot start reader processes")


def test_a_rank_without_row_groups_reads_nothing_and_starts_no_workers(tmp_path):
    small_dataset(tmp_path, n=20, rg=25, per_file=None)  # one row group: rank 1 of 2 gets none
    reader = BatchReader(tmp_path, 4, ReadOptions(workers=2, shard=Shard(1, 2)))
    it = reader.iter_with_state()
    assert next(it, None) is None and reader_workers() == []
    assert reader.state_dict()["epoch_done"] is True


@pytest.mark.numeric
def test_training_with_2_workers_matches_0_workers_bit_for_bit_and_resumes_with_0(tmp_path):
    from recaccel.cli import train_main
    from tests.helpers.dlrm_run import TINY, final_state, overrides, set_args

    data = tmp_path / "synth"
    tasks_config = load_config(None, [*TINY, f'synth.out_dir="{data}"'])
    generate_synthetic(tasks_config.synth)
    common = ["train.epochs=2", "train.steps=30"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main(set_args(overrides(data, full, *common, "data.workers=0"))) == 0
    # Stopped mid-epoch with 2 workers, then resumed in-process.
    assert train_main(set_args(overrides(data, part, *common, "data.workers=2", "train.steps=17"))) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=30", "--set", "data.workers=0"]) == 0
    a, b = final_state(full), final_state(part)
    assert a["step"] == b["step"] == 30
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    ma = json.loads((full / "metrics.json").read_text())
    mb = json.loads((part / "metrics.json").read_text())
    assert ma["auc"] == mb["auc"] and ma["logloss"] == mb["logloss"]


def test_data_workers_reaches_both_readers_for_training_and_evaluation(worker_rows_data, worker_task_data):
    data_cfg = DataConfig(workers=3)
    for train in (True, False):
        assert BatchReader.from_config(worker_rows_data, data_cfg, train=train).options.workers == 3
        assert (
            TaskReader.from_config(worker_task_data, tasks_config(), data_cfg, train=train).options.workers
            == 3
        )
    with pytest.raises(ConfigError, match="workers"):
        DataConfig(workers=-1)
