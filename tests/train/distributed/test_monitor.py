"""The communication monitor (as C4) and fault injection: an injected slow rank is flagged
and its peer is not, a clean run flags nothing, a hung rank is named, ``recaccel-monitor``
reads a run, and a killed rank's run resumes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.train.distributed.monitor import FIELDS, slow_ranks

HANG_TIMEOUT_S = 3.0
COMPUTE_S = 0.01  # the toy step's compute: well above the monitor's noise floor


def _row(compute: float, comm: float) -> list[float]:
    values = dict.fromkeys(FIELDS, 0.0)
    values.update(step_s=compute + comm, compute_s=compute, comm_s=comm)
    return [values[f] for f in FIELDS]


def test_slow_ranks_blames_the_straggler_not_the_peers_that_wait_for_it():
    # Rank 2 computes 3x longer; ranks 0 and 1 spend that difference waiting in collectives.
    rows = [_row(0.01, 0.021), _row(0.011, 0.020), _row(0.03, 0.001)]
    got = slow_ranks(rows, 2.0)
    assert list(got[2]) == ["compute"] and got[2]["compute"] == pytest.approx(
        0.03 / 0.0105
    )  # the others' median
    assert got[0] == {} and got[1] == {}
    # A rank whose own collectives are slow (beyond any wait for a slower peer).
    rows = [_row(0.01, 0.002), _row(0.01, 0.002), _row(0.01, 0.02)]
    assert [list(k) for k in slow_ranks(rows, 2.0)] == [[], [], ["collective"]]
    # Within the noise floor, or under the factor: nothing.
    assert slow_ranks([_row(0.0001, 0.0), _row(0.0005, 0.0)], 2.0) == [{}, {}]
    assert slow_ranks([_row(0.010, 0.0), _row(0.015, 0.0)], 2.0) == [{}, {}]


def test_config_errors_are_one_line():
    from recaccel.train.distributed.monitor import check_faults

    for override, key in (
        ("monitor.slow_factor=1", "monitor.slow_factor"),
        ("monitor.slow_steps=0", "monitor.slow_steps"),
        ("fault.slow_rank=-2", "fault.slow_rank"),
        ("fault.slow_factor=0.5", "fault.slow_factor"),
        ("fault.kill_rank_at_step=-1", "fault.kill_rank_at_step"),
    ):
        with pytest.raises(ConfigError, match=key) as e:
            load_config(None, [override])
        assert "\n" not in str(e.value)
    for overrides, key, world in (
        (["monitor.every=5"], "monitor.every=5", 1),
        (["fault.slow_rank=0"], "fault.slow_rank=0", 1),
        (["parallel.mode=hybrid", "fault.slow_rank=2"], "fault.slow_rank=2", 2),
        (["parallel.mode=hybrid", "fault.kill_rank=3", "fault.kill_rank_at_step=4"], "fault.kill_rank=3", 2),
    ):
        with pytest.raises(ConfigError, match=key) as e:
            check_faults(load_config(None, overrides), world)
        assert "\n" not in str(e.value)
    check_faults(load_config(None, ["parallel.mode=hybrid", "fault.slow_rank=1", "monitor.every=2"]), 2)


# ------------------------------------------------------------ two gloo ranks


class _Objective:
    """A toy objective: one linear layer, ``COMPUTE_S`` of compute per step."""

    loss = "bce"

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 1)

    def batch_loss(self, batch):
        time.sleep(COMPUTE_S)
        logits = self.module(batch.dense).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)


def _batches(n: int):
    from recaccel.sparse import Batch, SparseFeatures

    empty = SparseFeatures(["a"], torch.zeros(0, dtype=torch.int64), torch.zeros(5, dtype=torch.int64))
    return [Batch(torch.randn(4, 4), empty, torch.ones(4)) for _ in range(n)]


def _train(parallel, steps: int) -> list[dict]:
    objective = _Objective()
    optimizer = torch.optim.SGD(objective.module.parameters(), lr=0.1)
    events = []
    for step, batch in enumerate(parallel.batches(_batches(steps), objective), 1):
        parallel.train_step(objective, optimizer, batch)
        event = parallel.monitor.take_event()
        if event is not None:
            parallel.monitor.note_flags(event["flags"], step)
            events.append(event)
    return events


def _worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from recaccel.errors import RecaccelError
    from recaccel.train.distributed.hybrid import HybridParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    monitor = ["parallel.mode=hybrid", "monitor.every=2", "monitor.slow_steps=2", "monitor.slow_factor=2"]
    result = {}
    for name, faults in (("slow", ["fault.slow_rank=1", "fault.slow_factor=4"]), ("clean", [])):
        parallel = HybridParallel(load_config(None, [*monitor, *faults]), torch.device("cpu"))
        events = _train(parallel, 12)
        result[name] = {
            "events": events,
            "flags": parallel.monitor.flags,
            "summary": parallel.monitor.summary(),
        }
    # A hung rank: rank 1 stays alive but never joins rank 0's next agreement.
    parallel = HybridParallel(load_config(None, monitor), torch.device("cpu"))
    if rank == 1:
        time.sleep(HANG_TIMEOUT_S + 20)
        os._exit(0)
    try:
        next(parallel.batches(_batches(1), _Objective()))
        result["hang"] = None
    except RecaccelError as e:
        result["hang"] = f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(result))
    os._exit(0)


def test_two_ranks_flag_the_slowed_rank_only_and_name_a_hung_rank(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(120)
    procs[1].kill()
    procs[1].join()
    got = json.loads(out.read_text())

    slow = got["slow"]
    assert len(slow["events"]) == 6  # every 2 of 12 steps
    assert {(f["rank"], f["kind"]) for f in slow["flags"]} == {(1, "compute")}
    assert slow["flags"][0]["step"] == 4  # the 2nd gather in a row
    ranks = slow["summary"]["ranks"]
    assert ranks["1"]["compute_s"] > 3 * ranks["0"]["compute_s"] > 3 * COMPUTE_S * 0.9
    assert ranks["0"]["comm_s"] > ranks["1"]["comm_s"]  # rank 0 waits for rank 1
    # float64: has a batch, normaliser, rows, 2 ranks' timings and units, 2 stop slots
    agree = 8 * (3 + 2 * 2 + 2)
    assert ranks["0"]["bytes"] == ranks["1"]["bytes"] == agree + 5 * 4 + 4  # + Linear(4, 1) grads + loss
    assert slow["summary"]["gathers"] == 6 and slow["summary"]["every"] == 2

    clean = got["clean"]
    assert clean["flags"] == [] and all(e["flags"] == [] for e in clean["events"])
    assert len(clean["events"]) == 6

    assert got["hang"].startswith(
        "CollectiveError: rank 0 of 2: agreeing on the next step failed: rank 1 never"
    )
    assert "(agree; last: #" in got["hang"]


# ------------------------------------------------------------------ the CLI


TINY = [
    "synth.train_rows=2000",
    "synth.test_rows=500",
    "synth.num_dense=3",
    "synth.num_sparse=3",
    "synth.cardinality=40",
    "synth.multi_hot_fields=1",
    "synth.rows_per_row_group=500",
    "synth.rows_per_file=1000",
    "data.batch_size=64",
    "data.shuffle_buffer_rows=500",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.progress=false",
    "optim.sparse=rowwise_adagrad",
]


def _argv(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        *TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]
    return [arg for s in sets for arg in ("--set", s)]


def test_cli_run_logs_monitor_events_and_recaccel_monitor_shows_them(tmp_path, capsys):
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.cli import monitor_main, train_main
    from recaccel.io.convert.synth import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{data}"']).synth)
    run = tmp_path / "run"
    extra = ["parallel.mode=hybrid", "train.steps=12", "monitor.every=2", "monitor.slow_steps=2"]
    extra += ["fault.slow_rank=1", "fault.slow_factor=5"]
    assert train_main([*_argv(data, run, *extra), "--nproc", "2"]) == 0
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    gathers = [e for e in events if e["event"] == "monitor"]
    assert [e["step"] for e in gathers] == [2, 4, 6, 8, 10, 12]
    assert set(gathers[0]["ranks"]) == {"0", "1"} and gathers[0]["ranks"]["0"]["lookup_s"] > 0
    metrics = json.loads((run / "metrics.json").read_text())["monitor"]
    assert {(f["rank"], f["kind"]) for f in metrics["flags"]} == {(1, "compute")}
    assert metrics["ranks"]["1"]["compute_s"] > 2 * metrics["ranks"]["0"]["compute_s"]

    capsys.readouterr()
    assert monitor_main([str(run)]) == 0
    printed = capsys.readouterr().out
    table = printed.splitlines()
    assert table[0].split()[:3] == ["rank", "step", "ms"] and "flagged" in table[0]
    assert table[1].split()[0] == "0" and table[1].split()[-1] == "-"
    assert table[2].split()[0] == "1" and "compute from step" in table[2]
    png = run / "monitor.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A run without monitor events: one line, exit 2.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "log.jsonl").write_text(json.dumps({"event": "train", "step": 1}) + "\n")
    assert monitor_main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "monitor.every" in err


def test_killed_rank_exits_abruptly_and_the_run_resumes(tmp_path):
    from recaccel.io.convert.synth import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{data}"']).synth)
    run = tmp_path / "run"
    argv = _argv(data, run, "train.steps=6", "train.checkpoint_every=2", "fault.kill_rank_at_step=3")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "recaccel.cli", *argv], env=env, capture_output=True, text=True
    )
    assert done.returncode == 17, done.stderr
    assert [int(p.name.split("-")[1].split(".")[0]) for p in (run / "checkpoints").glob("step-*.pt")] == [2]
    resumed = [
        sys.executable,
        "-m",
        "recaccel.cli",
        "--resume",
        str(run),
        "--set",
        "fault.kill_rank_at_step=0",
    ]
    done = subprocess.run(resumed, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "metrics.json").read_text())["steps"] == 6
