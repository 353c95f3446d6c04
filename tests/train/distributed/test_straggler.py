"""Straggler mitigation (``parallel.straggler``): the split controller, the weighted-gradient
math of unequal splits, and two gloo ranks with one slowed rank under ``rebalance`` (the
same model as the equal split) and ``backup`` (every row trained once, the slow rank cut).

Row identity: a dense feature holding the row index / 1024.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.models.factory import build_model
from recaccel.sparse import Batch, SparseFeatures
from recaccel.train.distributed.straggler import (
    Backup,
    Off,
    Rebalance,
    build_policy,
    check_plan_kinds,
    check_straggler,
    split_units,
)
from recaccel.train.loop.observers import BatchCallback
from recaccel.train.model.objectives import DLRMObjective, loss_denominator
from tests.helpers.gloo_ranks import run_ranks

# ------------------------------------------------------------------ the controller


@pytest.mark.parametrize("total", [4, 7, 64, 1001])
@pytest.mark.parametrize("shares", [[0.25] * 4, [0.1, 0.2, 0.3, 0.4], [0.97, 0.01, 0.01, 0.01]])
def test_split_units_sums_to_the_batch_and_follows_the_shares(total, shares):
    parts = split_units(total, shares)
    assert sum(parts) == total and min(parts) >= 1
    spare = total - len(shares)
    for part, share in zip(parts, shares):
        assert abs((part - 1) - spare * share / sum(shares)) < 1.0  # largest remainder: within a unit


def test_split_units_refuses_a_batch_smaller_than_the_ranks():
    with pytest.raises(ConfigError, match="cannot give each of 4 ranks"):
        split_units(3, [0.25] * 4)


def _step_times(sizes: list[int], speeds: list[float], fixed_s: float = 0.002) -> list[float]:
    """A rank's compute: a fixed per-step cost plus its rows over its speed (rows/s)."""
    return [fixed_s + n / v for n, v in zip(sizes, speeds)]


def test_rebalance_converges_to_equal_compute_times():
    speeds = [1000.0, 1000.0, 500.0, 1000.0]  # rank 2 is 2x slow
    ctl = Rebalance(4, every=1)
    sizes = [64] * 4
    for _ in range(30):
        ctl.observe(_step_times(sizes, speeds), sizes)
        sizes = ctl.split(256)
    times = _step_times(sizes, speeds)
    assert max(times) / min(times) < 1.05
    assert sizes[2] < min(s for r, s in enumerate(sizes) if r != 2)
    # The slowest compute time fell from 2x to near the mean of an equal-speed cluster.
    assert max(times) < 0.75 * max(_step_times([64] * 4, speeds))


def test_backup_cuts_only_a_rank_beyond_the_factor_and_ignores_noise():
    ctl = Backup(4, every=2, backup_factor=1.5)
    sizes = [64] * 4
    noisy = [1000.0, 800.0, 1000.0, 900.0]  # 1.25x: below the factor
    for _ in range(4):
        ctl.observe(_step_times(sizes, noisy), sizes)
    assert ctl.shares == [0.25] * 4 and ctl.stragglers == [] and ctl.decisions == 2
    slow = [1000.0, 1000.0, 1000.0, 400.0]
    for _ in range(2):
        ctl.observe(_step_times(sizes, slow), sizes)
    assert ctl.stragglers == [3]
    cut = ctl.local_sizes(64)
    assert sum(cut) == 256 and cut[3] < 40 and cut[0] == cut[1] == cut[2]
    # Hysteresis: 1.3x (under the factor, over its square root) keeps it cut; 1.1x restores it.
    for speed, stragglers in ((1000 / 1.3, [3]), (1000 / 1.1, [])):
        per_row = [1000.0, 1000.0, 1000.0, speed]
        for _ in range(2):
            ctl.observe([n / v for n, v in zip(cut, per_row)], cut)
        assert ctl.stragglers == stragglers
    assert ctl.shares == [0.25] * 4


def test_a_window_with_an_idle_rank_decides_nothing():
    ctl = Rebalance(2, every=1)
    assert not ctl.observe([0.1, 0.0], [64, 0])
    assert not ctl.observe([0.0, 0.0], [0, 0])
    assert ctl.shares == [0.5, 0.5] and ctl.decisions == 0


@pytest.mark.parametrize(
    ("name", "data", "cls"),
    [("off", "global", Off), ("rebalance", "global", Rebalance), ("backup", "dynamic", Backup)],
)
def test_build_policy_picks_one_class_per_setting(name, data, cls):
    sets = ["parallel.mode=hybrid", f"parallel.straggler={name}", f"parallel.data={data}"]
    policy = build_policy(load_config(None, sets), rank=1, world_size=4)
    assert type(policy) is cls and policy.policy == name and policy.rank == 1


def test_off_never_moves_the_split_nor_reports():
    off = Off(rank=0, world_size=2)
    assert not off.observe([0.1, 0.4], [64, 64])
    assert off.local_batch("batch") == "batch" and not off.goes_on(1, True) and off.goes_on(2, True)
    assert off.summary() == {} and off.final_metrics() == {}


def test_checks_name_the_setting():
    with pytest.raises(ConfigError, match="needs parallel.data=global"):
        check_straggler(load_config(None, ["parallel.straggler=rebalance", "parallel.data=dynamic"]))
    with pytest.raises(ConfigError, match="needs parallel.data=dynamic"):
        check_straggler(load_config(None, ["parallel.straggler=backup"]))
    with pytest.raises(ConfigError, match="train.pipeline=off"):
        check_straggler(load_config(None, ["parallel.straggler=rebalance", "train.pipeline=sync"]))
    with pytest.raises(ConfigError, match="table 'c' .row_wise."):
        check_plan_kinds("backup", {"a": "table_wise", "c": "row_wise", "b": "column_wise"})
    check_plan_kinds("off", {"c": "row_wise"})


def test_single_process_refuses_a_straggler_policy():
    from recaccel.train.loop.trainer import build_parallel

    with pytest.raises(ConfigError, match="parallel.straggler=backup needs parallel.mode=hybrid"):
        build_parallel(load_config(None, ["parallel.straggler=backup"]), torch.device("cpu"))


# ------------------------------------------------------ the weighted-gradient math


def _batch(n: int, gen: torch.Generator, weights: bool) -> Batch:
    keys = ("a", "b")
    lengths = torch.randint(0, 3, (2, n), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.reshape(-1).cumsum(0)])
    values = torch.randint(0, 9, (int(offsets[-1]),), generator=gen)
    sparse = SparseFeatures(list(keys), values, offsets)
    labels = (torch.rand(n, generator=gen) > 0.5).float()
    w = torch.rand(n, generator=gen) + 0.5 if weights else None
    return Batch(torch.randn(n, 2, generator=gen), sparse, labels, w)


@pytest.mark.parametrize("loss,weights", [("bce", False), ("bce", True), ("mse", True)])
def test_unequal_splits_give_the_gradient_of_the_global_mean(loss, weights):
    """Rank r's loss counts by n_r / N: the summed gradients are the full batch's for any
    split, e.g. the controller's after a slow rank, down to a one-row slice."""
    cfg = load_config(
        None,
        [
            "model.embedding_dim=4",
            "model.bottom_mlp=[4]",
            "model.top_mlp=[4, 1]",
            "model.embedding_backend=per_table",
        ],
    )
    schema = FeatureSchema(dense=("x", "y"), sparse=(SparseField("a", 9), SparseField("b", 9)))
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.optim, schema, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    objective = DLRMObjective(cfg, model, loss)
    batch = _batch(23, torch.Generator().manual_seed(1), weights)

    def grads(parts: list[Batch]) -> list[torch.Tensor]:
        total = sum(loss_denominator(p, loss) for p in parts)
        shared = sum(objective.batch_loss(p) * (loss_denominator(p, loss) / total) for p in parts)
        return list(torch.autograd.grad(shared, params, allow_unused=True))

    whole = grads([batch])
    for shares in ([0.25] * 4, [0.4, 0.3, 0.2, 0.1], [0.97, 0.01, 0.01, 0.01]):
        sizes = split_units(23, shares)
        bounds = np.cumsum([0, *sizes])
        parts = [batch.slice_rows(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
        for got, want in zip(grads(parts), whole):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- two gloo ranks, one of them slow

WORLD = 2
ROWS, BATCH = 1024, 64
SCHEMA = FeatureSchema(dense=("row_id", "d1"), sparse=tuple(SparseField(f"s{i}", 40) for i in range(3)))
TRAIN = [
    f"data.batch_size={BATCH}",
    "data.shuffle_buffer_rows=128",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "optim.sparse=rowwise_adagrad",
    "parallel.mode=hybrid",
    "parallel.sharding=table_wise",
    "parallel.straggler_every=1",
    "fault.slow_factor=4",
    "train.epochs=1",
    "train.progress=false",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("straggler")
    for name, n, seed in (("train", ROWS, 0), ("test", 256, 1)):
        rng = np.random.default_rng(seed)
        cols = {"label": rng.integers(0, 2, n).astype(np.float32), "row_id": np.arange(n) / 1024.0}
        cols["d1"] = rng.normal(size=n)
        cols.update({f.name: rng.integers(0, 40, n) for f in SCHEMA.sparse})
        write_parquet(root / name, SCHEMA, cols, rows_per_row_group=128, rows_per_file=512)
    return root


def _job(rank: int, world: int, root: Path, jobs: list[tuple[str, list[str]]]) -> None:
    """Runs each job ``(name, sets)`` on this rank; ``name`` may end in ``:kill`` (a run whose
    peer dies, see ``fault.kill_rank``: the job list's last) or ``:resume`` (resumes the run
    of that name)."""
    from recaccel.errors import RecaccelError
    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.loop.trainer import Trainer

    for job, sets in jobs:
        name, _, mode = job.partition(":")
        cfg = load_config(
            None,
            [
                *TRAIN,
                *sets,
                f'data.train="{root / "train"}"',
                f'data.test="{root / "test"}"',
                f'train.out_dir="{root / name}"',
            ],
        )
        parallel = HybridParallel(cfg, torch.device("cpu"))
        log = root / f"{job.replace(':', '-')}-{rank}.ids"

        def record(step, batch, log=log) -> None:
            with open(log, "a") as f:
                f.write(" ".join(str(round(v * 1024)) for v in batch.dense[:, 0].tolist()) + "\n")

        trainer = Trainer(cfg, parallel=parallel, resume=mode == "resume", observers=[BatchCallback(record)])
        if mode == "kill":
            try:
                trainer.fit()
            except RecaccelError:
                pass  # rank 0: its peer died
            continue
        trainer.fit()
        state = consolidated_state_dict(parallel, trainer.module)
        if rank == 0:
            torch.save(state, root / f"{name}.pt")
            (root / f"{name}.shares.json").write_text(json.dumps(parallel.straggler.summary()))


def _spawn(root: Path, jobs: list[tuple[str, list[str]]]) -> None:
    run_ranks(_job, WORLD, root, jobs)


def _steps(path: Path) -> list[list[int]]:
    return [[int(i) for i in line.split()] if line else [] for line in path.read_text().split("\n")[:-1]]


@pytest.fixture(scope="module")
def runs(data) -> Path:
    pytest.importorskip("torchrec", exc_type=ImportError)
    slow = ["fault.slow_rank=1"]
    _spawn(
        data,
        [
            ("off", []),
            ("rebalance", ["parallel.straggler=rebalance", *slow]),
            ("backup", ["parallel.straggler=backup", "parallel.data=dynamic", *slow]),
        ],
    )
    return data


def test_rebalance_trains_the_equal_split_model_with_a_smaller_slow_share(runs):
    off = [_steps(runs / f"off-{r}.ids") for r in range(WORLD)]
    bal = [_steps(runs / f"rebalance-{r}.ids") for r in range(WORLD)]
    assert len(bal[0]) == len(bal[1]) == len(off[0]) == ROWS // BATCH
    # Every global batch is the same rows, split otherwise: the slow rank's share shrinks.
    for step in range(ROWS // BATCH):
        assert sorted(bal[0][step] + bal[1][step]) == sorted(off[0][step] + off[1][step])
    sizes = [len(s) for s in bal[1]]
    assert sizes[0] == BATCH // 2 and sizes[-1] < BATCH // 3, sizes
    summary = json.loads((runs / "rebalance.shares.json").read_text())
    assert summary["decisions"] > 0 and summary["shares"][1] < 0.4
    want, got = torch.load(runs / "off.pt"), torch.load(runs / "rebalance.pt")
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


def test_backup_trains_every_row_once_and_cuts_the_slow_rank(runs):
    steps = [_steps(runs / f"backup-{r}.ids") for r in range(WORLD)]
    assert len(steps[0]) == len(steps[1])  # both ranks join every step (a dry one with 0 rows)
    assert Counter(i for rank in steps for step in rank for i in step) == Counter(range(ROWS))
    slow = [len(s) for s in steps[1]]
    fast = [len(s) for s in steps[0]]
    assert slow[0] == fast[0] == BATCH
    assert min(slow) < BATCH // 2 and max(fast) > BATCH, (slow, fast)
    summary = json.loads((runs / "backup.shares.json").read_text())
    assert summary["stragglers"] == [1]
    metrics = json.loads((runs / "backup" / "metrics.json").read_text())
    assert np.isfinite(metrics["train_loss"]) and metrics["train_samples"] == ROWS
    assert metrics["straggler"]["stragglers"] == [1] and metrics["straggler"]["policy"] == "backup"
    events = [json.loads(line) for line in (runs / "backup" / "log.jsonl").read_text().splitlines()]
    splits = [e for e in events if e.get("event") == "straggler"]
    assert splits and splits[0]["stragglers"] == [1] and splits[0]["shares"][1] < 0.5


# ------------------------------------------------------------------ from the CLI


def test_cli_runs_each_policy_and_refuses_row_wise_tables(tmp_path, capsys):
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.cli import train_main
    from recaccel.io.convert.synth import generate_synthetic
    from tests.helpers.hybrid_run import HYBRID_TINY, hybrid_set_args

    data = tmp_path / "data"
    generate_synthetic(load_config(None, [*HYBRID_TINY, f'synth.out_dir="{data}"']).synth)
    common = ["train.steps=12", "parallel.mode=hybrid", "fault.slow_rank=1", "parallel.straggler_every=2"]
    refused = hybrid_set_args(
        data, tmp_path / "rw", *common, "parallel.straggler=rebalance", "parallel.sharding=row_wise"
    )
    assert train_main([*refused, "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("parallel.straggler=rebalance gives ranks unequal batches" in line for line in err), err
    for policy, data_mode in (("rebalance", "global"), ("backup", "dynamic")):
        out = tmp_path / policy
        argv = hybrid_set_args(
            data,
            out,
            *common,
            f"parallel.straggler={policy}",
            f"parallel.data={data_mode}",
            "parallel.sharding=table_wise",
            "fault.slow_factor=4",
        )
        assert train_main([*argv, "--nproc", "2"]) == 0, policy
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["steps"] == 12 and metrics["straggler"]["decisions"] >= 4, metrics.get("straggler")
        assert metrics["straggler"]["shares"][1] < 0.45, metrics["straggler"]


def test_backup_through_a_kill_and_a_resume_trains_every_row_once(data):
    """The ledger holds what each rank trained at its own batch sizes (the dry rank's empty
    steps included): a run killed mid-epoch and resumed trains every row exactly once."""
    pytest.importorskip("torchrec", exc_type=ImportError)
    backup = ["parallel.straggler=backup", "parallel.data=dynamic", "fault.slow_rank=1", "data.batch_size=16"]
    kill = ["fault.kill_rank=1", "fault.kill_rank_at_step=15", "train.checkpoint_every=6"]
    _spawn(data, [("bkill:kill", [*backup, *kill])])
    _spawn(data, [("bkill:resume", backup)])  # new processes: rank 1 died
    killed = [_steps(data / f"bkill-kill-{r}.ids") for r in range(WORLD)]
    assert len(killed[1]) == 15
    kept = 12  # the checkpoint before the kill
    assert any(len(step) < 16 for step in killed[1][:kept])  # the slow rank was cut before it
    before = [i for steps in killed for step in steps[:kept] for i in step]
    after = [i for r in range(WORLD) for step in _steps(data / f"bkill-resume-{r}.ids") for i in step]
    assert Counter(before + after) == Counter(range(ROWS))
