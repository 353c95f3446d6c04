"""Hybrid runs from the command line (``--nproc 2`` through torchrun), and a hung rank."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from tests.helpers.hybrid_run import HYBRID_TINY, hybrid_set_args

HANG_TIMEOUT_S = 2.0


def test_cli_trains_and_resumes_on_two_processes(tmp_path, capfd):
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.cli import train_main
    from recaccel.train.loop.trainer import Trainer

    data = tmp_path / "data"
    generate_synthetic(load_config(None, [*HYBRID_TINY, f'synth.out_dir="{data}"']).synth)
    out = tmp_path / "hybrid"
    argv = hybrid_set_args(data, out, "train.steps=10", "parallel.mode=hybrid", "parallel.sharding=row_wise")
    assert train_main([*argv, "--nproc", "2"]) == 0
    printed = capfd.readouterr().out
    assert printed.count("metrics written to") == 1  # rank 0 reports, rank 1 does not
    metrics = json.loads((out / "metrics.json").read_text())
    assert load_config(out / "config.toml").parallel.mode == "hybrid"
    events = [json.loads(line)["event"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert events.count("final") == 1 and events.count("train") == 10 // 4 + 1  # steps 1, 4, 8
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000000010.dcp"]

    sets = [a for a in argv if a != "--set"] + ["model.embedding_backend=reference", "parallel.mode=single"]
    single = Trainer(load_config(None, [*sets, f'train.out_dir="{tmp_path / "single"}"'])).fit()
    for key in ("auc", "logloss", "train_loss"):
        assert abs(metrics[key] - single[key]) <= 1e-5, key

    assert train_main(["--resume", str(out), "--set", "train.steps=14", "--nproc", "2"]) == 0
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["steps"] == 14 and resumed["train_samples"] == 14 * 128
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step-000000010.dcp", "step-000000014.dcp"]


def test_cli_trains_meta_dlrm_on_two_processes(tmp_path):
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.cli import train_main
    from recaccel.io.convert.group_by_task import group_by_task
    from recaccel.train.loop.trainer import Trainer

    raw, data = tmp_path / "raw", tmp_path / "data"
    generate_synthetic(load_config(None, [*HYBRID_TINY, f'synth.out_dir="{raw}"']).synth)
    for split in ("train", "test"):  # one task per value of the single-hot field C1
        group_by_task(raw / split, data / split, task_key="C1", task_column="user", rows_per_row_group=500)
    meta = [
        "train.mode=meta",
        "train.steps=6",
        "tasks.tasks_per_batch=8",
        "tasks.support_size=8",
        "tasks.query_size=8",
        "tasks.shuffle_buffer_tasks=16",
        "meta.inner_steps=1",
        "meta.first_order=false",
    ]
    out = tmp_path / "hybrid"
    assert train_main([*hybrid_set_args(data, out, *meta, "parallel.mode=hybrid"), "--nproc", "2"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    single_argv = hybrid_set_args(data, tmp_path / "single", *meta, "model.embedding_backend=reference")
    sets = [a for a in single_argv if a != "--set"]
    single = Trainer(load_config(None, sets)).fit()
    assert metrics["tasks"] == single["tasks"] > 0 and metrics["steps"] == 6
    for key in ("auc", "gauc", "logloss", "train_loss", "ndcg@3"):
        assert abs(metrics[key] - single[key]) <= 1e-5, key


def test_nproc_without_hybrid_mode_is_a_one_line_error(tmp_path, capsys):
    from recaccel.cli import train_main

    assert train_main(["--set", f'train.out_dir="{tmp_path}"', "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.mode=hybrid" in err


def _hung_worker(rank: int, port: int, out: str) -> None:
    from recaccel.errors import RecaccelError
    from recaccel.sparse import Batch, SparseFeatures
    from recaccel.train.distributed.hybrid import HybridParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    cfg = load_config(None, ["parallel.mode=hybrid", f"parallel.timeout_s={HANG_TIMEOUT_S}"])
    parallel = HybridParallel(cfg, torch.device("cpu"))
    batch = Batch(
        torch.zeros(2, 1),
        SparseFeatures(["a"], torch.zeros(2, dtype=torch.int64), torch.arange(3)),
        torch.zeros(2),
    )
    if rank == 1:
        time.sleep(30)  # alive but stuck: never joins the next collective
        os._exit(0)

    class Objective:
        loss = "bce"

    start = time.monotonic()
    try:
        next(parallel.batches([batch], Objective()))
        result = {"error": None}
    except RecaccelError as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    result["seconds"] = time.monotonic() - start
    Path(out).write_text(json.dumps(result))
    os._exit(0)


def test_hung_rank_times_out_with_a_clear_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hung_worker, args=(r, port, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(60)
    procs[1].kill()
    procs[1].join()
    got = json.loads(out.read_text())
    assert got["error"].startswith("CollectiveError: rank 0 of 2")
    assert f"parallel.timeout_s={HANG_TIMEOUT_S:g}s" in got["error"]
    assert HANG_TIMEOUT_S * 0.9 <= got["seconds"] < HANG_TIMEOUT_S + 10


def test_cli_trains_dcnv2_on_two_processes_as_one_process_does(tmp_path):
    # DCN-v2's cross layers are dense: replicated and summed over ranks like the MLPs.
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.cli import train_main
    from recaccel.train.loop.trainer import Trainer

    data = tmp_path / "data"
    generate_synthetic(load_config(None, [*HYBRID_TINY, f'synth.out_dir="{data}"']).synth)
    dcn = ("model.interaction=dcnv2", "model.dcn_layers=2", "model.dcn_rank=4", "train.steps=6")
    out = tmp_path / "hybrid"
    argv = hybrid_set_args(data, out, *dcn, "parallel.mode=hybrid", "parallel.sharding=table_wise")
    assert train_main([*argv, "--nproc", "2"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    sets = [a for a in argv if a != "--set"] + ["model.embedding_backend=reference", "parallel.mode=single"]
    single = Trainer(load_config(None, [*sets, f'train.out_dir="{tmp_path / "single"}"'])).fit()
    for key in ("auc", "logloss", "train_loss"):
        assert abs(metrics[key] - single[key]) <= 1e-5, key
