"""Elastic restarts and resumes on another number of ranks (issue 17): through a rank
failure and a restart, also with another world size, every row is trained exactly once
per epoch, counted by row identity; a resharded checkpoint loads the tables it saved.

Row identity: a dense feature holding the row index / 1024 (exact in float32). Ranks
started by ``recaccel-train --nproc`` record the rows each step trains through a
test-only ``sitecustomize`` on their ``PYTHONPATH`` that adds a ``BatchCallback`` observer to the Trainer.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recaccel.config import load_config
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet

# 18 row groups of 32 rows. dynamic: batches of 32 rows per rank (a shard is one batch);
# global: global batches of 96 rows (32 per rank at 3 ranks, 48 at 2).
ROWS, GROUP = 576, 32
SCHEMA = FeatureSchema(dense=("row_id", "d1"), sparse=tuple(SparseField(f"s{i}", 40) for i in range(3)))
COMMON = [
    "data.shuffle_buffer_rows=96",
    "data.shard_row_groups=1",
    "model.embedding_dim=8",
    "model.bottom_mlp=[8, 8]",
    "model.top_mlp=[8, 1]",
    "optim.sparse=rowwise_adagrad",
    "parallel.mode=hybrid",
    "parallel.sharding=table_wise",
    "train.epochs=1",
    "train.progress=false",
    "train.log_every=2",
    "parallel.timeout_s=60",  # a hung rank fails the test instead of stalling it
]
BATCH = {"dynamic": 32, "global": 96}

# Test-only: every rank appends the row ids of each step it trains, one line per step, to
# $RECACCEL_TEST_ROWS/<tag>-<attempt>-<rank>.ids (attempt: torchrun's restart count).
HOOK = """
import os

if os.environ.get("RECACCEL_TEST_ROWS") and os.environ.get("RANK") is not None:
    from recaccel.train.loop.observers import BatchCallback
    from recaccel.train.loop.trainer import Trainer

    _init = Trainer.__init__

    def __init__(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        name = "-".join(
            [os.environ["RECACCEL_TEST_TAG"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), str(self.parallel.rank)]
        )
        path = os.path.join(os.environ["RECACCEL_TEST_ROWS"], name + ".ids")

        def record(step, batch):
            with open(path, "a") as f:
                f.write(" ".join(str(round(v * 1024)) for v in batch.dense[:, 0].tolist()) + "\\n")

        self.observers.add(BatchCallback(record))

    Trainer.__init__ = __init__
"""


def _write(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cols = {"label": rng.integers(0, 2, n).astype(np.float32), "row_id": np.arange(n) / 1024.0}
    cols["d1"] = rng.normal(size=n)
    cols.update({f.name: rng.integers(0, 40, n) for f in SCHEMA.sparse})
    write_parquet(path, SCHEMA, cols, rows_per_row_group=GROUP, rows_per_file=6 * GROUP)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    pytest.importorskip("torchrec", exc_type=ImportError)
    root = tmp_path_factory.mktemp("elastic")
    _write(root / "train", ROWS, 0)
    _write(root / "test", 96, 1)
    return root


def _sets(data: Path, out: Path, mode: str, *extra: str) -> list[str]:
    return [
        *COMMON,
        f"data.batch_size={BATCH[mode]}",
        f"parallel.data={mode}",
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]


def _argv(sets: list[str], *extra: str) -> list[str]:
    return [*(arg for s in sets for arg in ("--set", s)), *extra]


@pytest.fixture
def rows(tmp_path, monkeypatch) -> Path:
    """Where the ranks of ``recaccel-train --nproc`` launched by this test record their rows."""
    hook, out = tmp_path / "hook", tmp_path / "rows"
    hook.mkdir()
    out.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    path = [str(hook), str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    monkeypatch.setenv("RECACCEL_TEST_ROWS", str(out))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return out


def _steps(rows: Path, tag: str, attempt: int, rank: int) -> list[list[int]]:
    path = rows / f"{tag}-{attempt}-{rank}.ids"
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()] if path.exists() else []


def _trained(rows: Path, tag: str, attempt: int, world: int, first: int | None = None) -> list[int]:
    """Row ids the ranks of one attempt trained (in their first ``first`` steps)."""
    return [i for r in range(world) for step in _steps(rows, tag, attempt, r)[:first] for i in step]


def _sane(out: Path, steps: int) -> dict:
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["steps"], metrics["epochs"], metrics["train_samples"]) == (steps, 1, ROWS)
    assert 0.0 <= metrics["auc"] <= 1.0 and math.isfinite(metrics["logloss"])
    assert math.isfinite(metrics["train_loss"])
    return metrics


def test_an_elastic_restart_resumes_and_trains_every_row_once(data, rows, tmp_path, monkeypatch):
    from recaccel.cli import train_main

    kill_at, every = 5, 2  # the restart resumes from the checkpoint of step 4
    out = tmp_path / "run"
    faults = ["fault.kill_rank=1", f"fault.kill_rank_at_step={kill_at}", f"train.checkpoint_every={every}"]
    monkeypatch.setenv("RECACCEL_TEST_TAG", "run")
    argv = _argv(_sets(data, out, "dynamic", *faults), "--nproc", "2", "--max-restarts", "1", "--overwrite")
    assert train_main(argv) == 0
    assert len(_steps(rows, "run", 0, 1)) == kill_at  # rank 1 died after step 5 of the first attempt
    kept = kill_at - kill_at % every
    before, after = _trained(rows, "run", 0, 2, kept), _trained(rows, "run", 1, 2)
    assert Counter(before + after) == Counter(range(ROWS))
    assert len(_steps(rows, "run", 1, 0)) == ROWS // (2 * BATCH["dynamic"]) - kept
    _sane(out, ROWS // (2 * BATCH["dynamic"]))


def test_a_restarted_rank_resumes_and_never_overwrites(data, tmp_path, monkeypatch, capsys):
    """What a rank decides from ``TORCHELASTIC_RESTART_COUNT`` (no ranks launched)."""
    from recaccel import api
    from recaccel.cli import train_main
    from recaccel.train.distributed.launch import restart_count, strip_nproc

    calls = []

    class Called(Exception):
        pass

    def train(cfg, **kwargs):
        calls.append(kwargs)
        raise Called

    monkeypatch.setattr(api, "train", train)
    argv = _argv(_sets(data, tmp_path / "run", "dynamic"), "--overwrite")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for count, expected in (
        ("0", {"resume": False, "overwrite": True}),
        ("1", {"resume": True, "overwrite": False}),
    ):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        assert restart_count() == int(count)
        with pytest.raises(Called):
            train_main(argv)
        assert calls.pop() == expected
    assert strip_nproc(["--nproc", "2", "--max-restarts", "1", "-v", "--max-restarts=2"]) == ["-v"]
    monkeypatch.delenv("RANK")
    assert train_main([*argv, "--max-restarts", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-restarts restarts the ranks of --nproc N" in err


@pytest.mark.parametrize("mode", ["dynamic", "global"])
def test_killed_at_three_ranks_resumed_on_two_trains_every_row_once(data, rows, tmp_path, monkeypatch, mode):
    from recaccel.cli import train_main

    kill_at, every = 3, 2
    out = tmp_path / "run"
    faults = ["fault.kill_rank=2", f"fault.kill_rank_at_step={kill_at}", f"train.checkpoint_every={every}"]
    monkeypatch.setenv("RECACCEL_TEST_TAG", "kill")
    assert train_main(_argv(_sets(data, out, mode, *faults), "--nproc", "3")) == 2
    assert len(_steps(rows, "kill", 0, 2)) == kill_at
    kept = kill_at - kill_at % every
    monkeypatch.setenv("RECACCEL_TEST_TAG", "resume")
    assert train_main(["--resume", str(out), "--nproc", "2", "--set", "fault.kill_rank_at_step=0"]) == 0
    assert Counter(_trained(rows, "kill", 0, 3, kept) + _trained(rows, "resume", 0, 2)) == Counter(
        range(ROWS)
    )
    if mode == "dynamic":  # a step trains 3 then 2 batches of 32 rows
        metrics = _sane(out, kept + (ROWS - 3 * 32 * kept) // (2 * 32))
        return
    metrics = _sane(out, ROWS // BATCH["global"])
    # global batches train what one process trains, whatever the number of ranks
    from recaccel.train.loop.trainer import Trainer

    single = ["model.embedding_backend=reference", "parallel.mode=single"]
    reference = Trainer(load_config(None, _sets(data, tmp_path / "single", mode, *single))).fit()
    for key in ("auc", "logloss", "train_loss"):
        assert abs(metrics[key] - reference[key]) <= 1e-5, key


# ------------------------------------------- resharded loads, in-process gloo ranks

RESHARD = {  # run -> its extra settings; each is saved at 3 ranks and loaded at 2
    "table_wise": [],
    "row_wise": ["parallel.sharding=row_wise"],
    "column_wise": ["parallel.sharding=column_wise"],  # 2 column shards at 3 and at 2 ranks
    "auto": ["parallel.sharding=auto", 'parallel.table_sharding=["s1=data_parallel"]'],
    # 4 column shards at 3 ranks, 2 at 2 ranks
    "column_wise_16": ["parallel.sharding=column_wise", "model.embedding_dim=16", "model.bottom_mlp=[8, 16]"],
    "sharded": ["parallel.data=sharded"],
}
REFUSED = ("column_wise_16", "sharded")


def _reshard_cfg(root: Path, run: str):
    extra = [*RESHARD[run], "train.steps=2"]
    return load_config(None, _sets(root, root / run, "global", *extra))


def _reshard_job(rank: int, world: int, port: int, root: str, phase: str) -> None:
    from recaccel.errors import RecaccelError
    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict
    from recaccel.train.loop.trainer import Trainer

    torch.set_num_threads(1)
    root = Path(root)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        for run in RESHARD:
            if phase == "save":
                trainer = Trainer(_reshard_cfg(root, run))
                trainer.fit()
            else:
                try:
                    trainer = Trainer(_reshard_cfg(root, run), resume=True)
                except RecaccelError as e:
                    (root / f"{run}-refused-{rank}.txt").write_text(str(e))
                    continue
            state = consolidated_state_dict(trainer.parallel, trainer.objective.module)
            accumulators = _column_accumulators(trainer.parallel)
            if rank == 0:
                state.update(accumulators)
                torch.save(state, root / f"{run}-{phase}.pt")
    except BaseException:
        (root / f"error-{phase}-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _column_accumulators(parallel) -> dict[str, torch.Tensor]:
    """Row-wise Adagrad state of column-wise tables, whole: [R * column shards] by table
    (consolidated_state_dict leaves it out: it has no single-process form)."""
    from recaccel.train.distributed.sharding import plan_rows

    column_wise = {row["table"] for row in plan_rows(parallel.plan) if row["sharding"] == "column_wise"}
    pieces = []
    for states in parallel.dmp.fused_optimizer.state_dict()["state"].values():
        for name, value in states.items():
            if name.endswith(".momentum1") and name.rpartition(".")[0] in column_wise:
                for shard in value.local_shards():
                    pieces.append(
                        (name, value.size(0), shard.metadata.shard_offsets[0], shard.tensor.clone())
                    )
    gathered = [None] * parallel.world_size
    dist.all_gather_object(gathered, pieces)
    out: dict[str, torch.Tensor] = {}
    for name, size, offset, tensor in (p for rank_pieces in gathered for p in rank_pieces):
        full = out.setdefault(f"{name}.per_column_shard", torch.zeros(size))
        full[offset : offset + tensor.numel()] = tensor
    return out


def _spawn(root: Path, world: int, phase: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_reshard_job, args=(r, world, port, str(root), phase)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        if p.is_alive():
            p.kill()
    errors = [f.read_text() for f in sorted(root.glob(f"error-{phase}-*.txt"))]
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="module")
def resharded(data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reshard")
    for split in ("train", "test"):
        (root / split).symlink_to(data / split)
    _spawn(root, 3, "save")
    _spawn(root, 2, "load")
    return root


@pytest.mark.parametrize("run", [r for r in RESHARD if r not in REFUSED])
def test_a_checkpoint_of_three_ranks_loads_its_tables_on_two(resharded, run):
    saved = torch.load(resharded / f"{run}-save.pt")
    loaded = torch.load(resharded / f"{run}-load.pt")
    assert sorted(loaded) == sorted(saved)
    tables = [k for k in saved if ".embedding." in k and k.endswith(".weight")]
    accumulators = [k for k in saved if "momentum1" in k]
    assert len(tables) == 3 and len(accumulators) == 3
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    # what was loaded was trained: the accumulators left zero
    assert all(saved[k].abs().sum() > 0 for k in accumulators)


def test_column_shards_cut_elsewhere_are_refused_naming_the_table(resharded):
    messages = {(resharded / f"column_wise_16-refused-{r}.txt").read_text() for r in range(2)}
    assert len(messages) == 1
    message = messages.pop()
    assert "\n" not in message and "table 's0' (column_wise here)" in message
    assert "[0, 4, 8, 12] by 3 ranks and [0, 8] by 2" in message and "--nproc 3" in message


def test_sharded_data_on_another_world_size_is_refused_in_one_line(resharded, capsys):
    from recaccel.cli import train_main

    for r in range(2):
        message = (resharded / f"sharded-refused-{r}.txt").read_text()
        assert "parallel.data=sharded" in message and "--nproc 3" in message
    assert train_main(["--resume", str(resharded / "sharded"), "--nproc", "2"]) == 2  # before any rank starts
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "written by 3 ranks with parallel.data=sharded" in err
