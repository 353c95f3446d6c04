"""A rank of ``recaccel-train --nproc 2`` fails: exit 2 and one line about the rank that failed first."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic

TINY = [
    "synth.train_rows=3000",
    "synth.test_rows=500",
    "synth.num_dense=2",
    "synth.num_sparse=2",
    "synth.cardinality=20",
    "synth.rows_per_row_group=500",
    "synth.rows_per_file=1500",
    "data.batch_size=100",
    "data.shuffle_buffer_rows=500",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8, 4]",
    "model.top_mlp=[8, 1]",
    "train.progress=false",
    "train.log_every=1",
    "parallel.mode=hybrid",
    "parallel.sharding=row_wise",
]
WAIT_S = 90.0


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{data}"']).synth)
    return data


def _argv(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        *TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]
    return [*(arg for s in sets for arg in ("--set", s)), "--nproc", "2"]


def _ranks() -> dict[int, int]:
    """Rank -> pid of this process's children that are torchrun ranks (read from /proc)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != os.getpid():
                continue
            env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        if b"RANK" in env and b"WORLD_SIZE" in env:
            found[int(env[b"RANK"])] = int(proc.name)
    return found


def _training(log: Path) -> bool:
    """Rank 0 has logged a training step (both ranks are past the start-up)."""
    if not log.is_file():
        return False
    for line in log.read_text().splitlines():
        try:
            if json.loads(line).get("event") == "train":
                return True
        except json.JSONDecodeError:
            pass  # a line being written
    return False


def _ours(err: str) -> list[str]:
    """recaccel's lines in ``err`` (the ranks' libraries may warn on their own)."""
    return [line for line in err.splitlines() if line.startswith("recaccel")]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_a_killed_rank_is_named_in_one_line_and_the_others_are_stopped(tmp_path, capfd):
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.cli import train_main

    data, out = _data(tmp_path), tmp_path / "run"
    seen: dict[int, int] = {}

    def kill_rank_1_once_training() -> None:
        deadline = time.monotonic() + WAIT_S
        log = out / "log.jsonl"
        while time.monotonic() < deadline:
            seen.update(_ranks())
            if _training(log) and 1 in seen:
                os.kill(seen[1], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_rank_1_once_training, daemon=True)
    killer.start()
    started = time.monotonic()
    status = train_main(_argv(data, out, "train.steps=1000000"))
    elapsed = time.monotonic() - started
    killer.join(1)
    err = capfd.readouterr().err

    assert set(seen) == {0, 1}, f"ranks not found: {seen}"
    assert status == 2
    # The ranks' own output passes through (library warnings); the launcher adds one line.
    assert _ours(err) == [f"recaccel-train: error: rank 1 failed first: killed by SIGKILL (pid {seen[1]})"]
    assert err.count("SIGKILL") == 1 and "rank 0 of 2" not in err  # rank 0's lost peer is not shown
    assert "Traceback" not in err and "ChildFailedError" not in err and "root cause" not in err.lower()
    for pid in seen.values():  # the surviving rank was stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert elapsed < WAIT_S


def test_a_rank_error_is_shown_once_as_the_rank_wrote_it(tmp_path, capfd):
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.cli import train_main

    data = _data(tmp_path)
    # Row group 1 of the first file (rows 500..999) holds a label 2.0. Read in file order and
    # sharded by row group, it is rank 1's first row group: rank 1 fails on its data, rank 0
    # then loses its peer (a CollectiveError, or stopped by the agent), which must not be named.
    path = data / "train" / "part-00000.parquet"
    table = pq.read_table(path)
    labels = table.column("label").to_pylist()
    labels[700] = 2.0
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.float32()))
    pq.write_table(table, path, row_group_size=500)

    status = train_main(
        _argv(data, tmp_path / "run", "train.steps=20", "parallel.data=sharded", "data.shuffle=false")
    )
    err = capfd.readouterr().err
    lines = _ours(err)

    assert status == 2
    assert len(lines) == 1, lines
    assert "rank 0 of 2" not in err and "Traceback" not in err
    assert lines[0].startswith("recaccel-train: error: file ") and str(path) in lines[0]
    assert "row group 1" in lines[0] and "label" in lines[0] and "2.0" in lines[0]


def test_first_failure_is_not_a_lost_peer_then_earliest_then_first_recorded(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from recaccel.errors import DataError
    from recaccel.train.distributed.hybrid import CollectiveError
    from recaccel.train.distributed.launch import first_failure, rank_failure, report_rank_error

    made = iter(range(100))

    def failure(rank: int, exitcode: int, error: Exception | None = None) -> ProcessFailure:
        path = tmp_path / f"error-{next(made)}.json"
        if error is not None:  # written by the rank's own CLI code path
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", "3")
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            assert report_rank_error(error)
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))

    lost = failure(0, 2, CollectiveError("rank 0 of 3: allreduce failed: a peer rank exited"))
    killed = failure(1, -signal.SIGKILL)
    stopped = failure(2, -signal.SIGTERM)  # recorded after: the agent stopped it
    assert first_failure({0: lost, 1: killed, 2: stopped}) == (1, killed)
    expected = "rank 1 failed first: killed by SIGKILL (pid 1001)"
    assert str(rank_failure({0: lost, 1: killed, 2: stopped})) == expected
    assert str(rank_failure({0: lost})) == "rank 0 of 3: allreduce failed: a peer rank exited"

    bad = failure(2, 2, DataError("bad label", path="f.parquet", row_group=1))
    bad.timestamp = killed.timestamp - 1
    assert str(rank_failure({0: lost, 1: killed, 2: bad})) == "file f.parquet, row group 1: bad label"
    crashed = failure(0, 1)
    crashed.timestamp = killed.timestamp
    assert str(rank_failure({0: crashed, 1: killed})) == "rank 0 failed first: exit status 1 (pid 1000)"


def test_errors_are_printed_outside_a_torchrun_agent(monkeypatch, tmp_path, capsys):
    from recaccel.cli import train_main
    from recaccel.train.distributed.launch import report_rank_error

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not report_rank_error(ValueError("x"))  # no agent to hand it to
    assert train_main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err
    # Under an agent the line goes to its error file, in torchrun's format.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e" / "error.json"))
    assert train_main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert capsys.readouterr().err == ""
    data = json.loads((tmp_path / "e" / "error.json").read_text())
    assert "missing.toml" in data["message"]["extraInfo"]["py_callstack"]
    assert "missing.toml" in data["recaccel"]["message"] and data["recaccel"]["peer_failure"] is False
