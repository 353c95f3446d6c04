"""Hybrid training on 2 CPU processes (gloo) equals training in one process.

One pair of worker processes runs every multi-process check in turn (TorchRec imports
slowly): DLRM with table-wise, row-wise (+ one data-parallel table) and column-wise
sharding through the Trainer, a resume from a sharded checkpoint, a meta-DLRM step
with counted collectives, and finally rank 1 dying mid-training. The parent process
trains the single-process references meanwhile and compares.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec", exc_type=ImportError)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from recaccel.config import load_config  # noqa: E402
from recaccel.io.convert.synth import generate_synthetic  # noqa: E402
from recaccel.io.format.schema import FeatureSchema, SparseField  # noqa: E402
from recaccel.sparse import Batch, SparseFeatures, TaskBatch  # noqa: E402
from recaccel.train.checkpoint.state import list_checkpoints  # noqa: E402
from tests.helpers.hybrid_run import SHARDED_TINY, STEPS, WORLD, free_port, sharded_overrides

# Floats of the per-step agreement: has a batch, normaliser, rows, each rank's timing and units,
# then one stop-request slot per signal (SIGTERM, SIGINT).
AGREE = 3 + 2 * WORLD + 2
# name -> (overrides of the hybrid run, overrides shared with its single-process reference)
RUNS = {
    "tw": (["parallel.sharding=table_wise"], []),
    "rw_dp": (["parallel.sharding=row_wise", 'parallel.table_sharding=["C4=data_parallel"]'], []),
    "cw_sgd": (["parallel.sharding=column_wise"], ["optim.sparse=sgd"]),
}
META = [
    "model.embedding_dim=8",
    "model.bottom_mlp=[8, 8]",
    "model.top_mlp=[8, 1]",
    "optim.dense=adam",
    "optim.lr=0.01",
    "optim.sparse_lr=0.05",
    "meta.inner_steps=2",
    "meta.inner_lr=0.1",
    "meta.first_order=false",
    "meta.meta_sgd=true",
    "meta.adapt=head",
    "parallel.sharding=table_wise",
]
META_STEPS, TASKS, SUPPORT, QUERY, ROWS = 3, 4, 5, 6, 20
KILL_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ meta helpers


def _meta_schema() -> FeatureSchema:
    return FeatureSchema(dense=("d0", "d1", "d2"), sparse=tuple(SparseField(f"s{i}", ROWS) for i in range(3)))


def _rows(n: int, gen: torch.Generator) -> Batch:
    keys = [f"s{i}" for i in range(3)]
    lengths = torch.randint(0, 3, (3 * n,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    labels = torch.randint(0, 2, (n,), generator=gen).float()
    return Batch(torch.randn(n, 3, generator=gen), SparseFeatures.from_lengths(keys, values, lengths), labels)


def _task_batches() -> list[TaskBatch]:
    """Global TaskBatches; in each, task 2 has no real query row (it must not count)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(META_STEPS):
        s_mask = (torch.rand(TASKS, SUPPORT, generator=gen) > 0.3).float()
        q_mask = (torch.rand(TASKS, QUERY, generator=gen) > 0.3).float()
        s_mask[:, 0] = q_mask[:, 0] = 1.0
        q_mask[2] = 0.0
        support, query = _rows(TASKS * SUPPORT, gen), _rows(TASKS * QUERY, gen)
        out.append(TaskBatch(support, query, s_mask, q_mask, torch.arange(TASKS)))
    return out


def _meta_objective():
    from recaccel.models.factory import build_model
    from recaccel.train.model.objectives import MetaObjective
    from recaccel.train.model.optim import build_dense_optimizer

    cfg = load_config(None, META)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.optim, _meta_schema(), torch.device("cpu"))
    objective = MetaObjective(cfg, model, "bce")
    return cfg, objective, lambda: build_dense_optimizer(objective.module, cfg.optim)


def _meta_single() -> tuple[dict, list[float]]:
    _, objective, make_optimizer = _meta_objective()
    optimizer = make_optimizer()
    losses = []
    for tb in _task_batches():
        optimizer.zero_grad(set_to_none=True)
        loss = objective.batch_loss(tb)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return objective.module.state_dict(), losses


# ------------------------------------------------------------------ worker jobs


def _job_run(rank: int, root: Path, name: str, extra: list[str]) -> dict:
    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict
    from recaccel.train.distributed.sharding import plan_rows
    from recaccel.train.loop.trainer import Trainer

    cfg = load_config(None, sharded_overrides(root / "data", root / name, "parallel.mode=hybrid", *extra))
    trainer = Trainer(cfg)
    metrics = trainer.fit()
    state = consolidated_state_dict(trainer.parallel, trainer.objective.module)
    plan = plan_rows(trainer.parallel.plan) if trainer.parallel.plan is not None else []
    return {"metrics": metrics, "state": state, "plan": plan}


def _job_resume(rank: int, root: Path) -> dict:
    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict
    from recaccel.train.loop.trainer import Trainer

    extra = ["parallel.mode=hybrid", *RUNS["tw"][0]]
    first = load_config(None, sharded_overrides(root / "data", root / "resumed", *extra, "train.steps=5"))
    Trainer(first).fit()
    trainer = Trainer(
        load_config(None, sharded_overrides(root / "data", root / "resumed", *extra)), resume=True
    )
    metrics = trainer.fit()
    return {"metrics": metrics, "state": consolidated_state_dict(trainer.parallel, trainer.objective.module)}


def _job_meta(rank: int, root: Path) -> dict:
    import recaccel.meta.learner as learner_module
    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.distributed.hybrid_data import row_bounds

    cfg, objective, make_optimizer = _meta_objective()
    parallel = HybridParallel(cfg, torch.device("cpu"))
    parallel.wrap(objective.module)
    optimizer = make_optimizer()
    dense_numel = sum(p.numel() for p in parallel.dense_parameters(optimizer))
    phase = ["idle"]
    calls: list[tuple[str, str, int]] = []
    names = [
        "all_reduce",
        "all_to_all_single",
        "all_to_all",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "barrier",
        "send",
        "recv",
    ]
    originals = {n: getattr(dist, n) for n in names}

    def counted(n):
        def call(*args, **kwargs):
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            calls.append((phase[0], n, -1 if tensor is None else tensor.numel()))
            return originals[n](*args, **kwargs)

        return call

    run_engine = learner_module.run_engine

    def inner(*args, **kwargs):  # MAML's inner loop and query forward
        phase[0] = "inner"
        try:
            return run_engine(*args, **kwargs)
        finally:
            phase[0] = "forward"

    class Phased:
        loss = "bce"
        module = objective.module

        def batch_loss(self, batch):
            phase[0] = "forward"
            value = objective.batch_loss(batch)
            phase[0] = "backward+sync"
            return value

    local = [tb.slice_tasks(*row_bounds(tb.num_tasks, rank, WORLD)) for tb in _task_batches()]
    losses, ends = [], [0]
    for n in names:
        setattr(dist, n, counted(n))
    learner_module.run_engine = inner
    try:
        phase[0] = "agree"
        for batch in parallel.batches(local, Phased()):
            losses.append(float(parallel.train_step(Phased(), optimizer, batch)))
            ends.append(len(calls))
            phase[0] = "agree"
    finally:
        for n in names:
            setattr(dist, n, originals[n])
        learner_module.run_engine = run_engine
    state = consolidated_state_dict(parallel, objective.module)
    per_step = [calls[a:b] for a, b in zip(ends[:-1], ends[1:])]
    return {
        "state": state,
        "losses": losses,
        "calls": per_step,
        "tail": calls[ends[-1] :],
        "dense_numel": dense_numel,
    }


def _job_kill(rank: int, root: Path) -> dict:
    from recaccel.errors import RecaccelError
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.loop.trainer import Trainer

    step = HybridParallel.train_step
    seen = {"n": 0, "t": time.monotonic()}

    def dying(self, objective, optimizer, batch):
        seen["n"] += 1
        seen["t"] = time.monotonic()
        if rank == 1 and seen["n"] == 3:
            os._exit(17)
        return step(self, objective, optimizer, batch)

    HybridParallel.train_step = dying
    cfg = load_config(None, sharded_overrides(root / "data", root / "killed", "parallel.mode=hybrid"))
    try:
        Trainer(cfg).fit()
    except RecaccelError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - seen["t"]}
    return {"error": None}


def _worker(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    root = Path(root)
    jobs = [(f"run_{name}", lambda r, p, n=name: _job_run(r, p, n, RUNS[n][0] + RUNS[n][1])) for name in RUNS]
    jobs += [("resume", _job_resume), ("meta", _job_meta), ("kill", _job_kill)]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=KILL_TIMEOUT_S),
        )
        for name, job in jobs:
            torch.save(job(rank, root), root / f"{name}-{rank}.pt")
    except BaseException:
        (root / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # the peer is gone after the kill job: skip the process-group teardown


def _single(data: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    from recaccel.train.loop.trainer import Trainer

    cfg = load_config(None, sharded_overrides(data, out, "model.embedding_backend=reference", *extra))
    metrics = Trainer(cfg).fit()
    return metrics, torch.load(list_checkpoints(out)[-1], weights_only=True)["model"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    generate_synthetic(load_config(None, [*SHARDED_TINY, f'synth.out_dir="{root / "data"}"']).synth)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(root))) for r in range(WORLD)]
    for p in procs:
        p.start()
    refs = {name: _single(root / "data", root / f"single_{name}", *RUNS[name][1]) for name in RUNS}
    meta_ref = _meta_single()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [f.read_text() for f in sorted(root.glob("error-*.txt"))]
    assert not errors, "\n".join(errors)
    got = {f.stem: torch.load(f, weights_only=False) for f in root.glob("*-*.pt")}
    return {
        "root": root,
        "refs": refs,
        "meta_ref": meta_ref,
        "got": got,
        "exitcodes": [p.exitcode for p in procs],
    }


def _assert_states_close(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", list(RUNS))
def test_dlrm_hybrid_equals_single_process(results, name):
    metrics, state = results["refs"][name]
    got = results["got"][f"run_{name}-0"]
    _assert_states_close(got["state"], state)
    for key in ("auc", "logloss", "train_loss"):
        assert abs(got["metrics"][key] - metrics[key]) <= 1e-5, key
    assert got["metrics"]["steps"] == metrics["steps"] == STEPS
    assert got["metrics"]["train_samples"] == metrics["train_samples"]
    wanted = dict(p.split("=") for p in RUNS[name][0] if p.startswith("parallel.sharding="))
    kinds = {row["table"]: row["sharding"] for row in got["plan"]}
    assert set(kinds.values()) == {wanted["parallel.sharding"]}
    if name == "rw_dp":  # C4 is replicated, outside TorchRec
        assert "C4" not in kinds and len(kinds) == 3
    if name == "cw_sgd":  # really split over both ranks
        assert all(len(row["shards"]) == WORLD for row in got["plan"])


def test_only_rank0_writes_run_files(results):
    run = results["root"] / "tw"
    assert (run / "metrics.json").is_file() and (run / "config.toml").is_file()
    lines = (run / "log.jsonl").read_text().splitlines()
    assert sum('"event": "final"' in line for line in lines) == 1  # not one per rank
    assert list((run / "checkpoints").glob("step-*.dcp"))


def test_resume_from_sharded_checkpoint_matches_uninterrupted_run(results):
    resumed, straight = results["got"]["resume-0"], results["got"]["run_tw-0"]
    _assert_states_close(resumed["state"], straight["state"], atol=1e-7)
    assert resumed["metrics"]["steps"] == STEPS
    assert resumed["metrics"]["train_samples"] == straight["metrics"]["train_samples"]
    assert abs(resumed["metrics"]["auc"] - straight["metrics"]["auc"]) <= 1e-7


def test_meta_hybrid_step_equals_single_process(results):
    state, losses = results["meta_ref"]
    got = results["got"]["meta-0"]
    _assert_states_close(got["state"], state)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", range(WORLD))
def test_meta_inner_loop_is_silent_and_outer_step_syncs_once(results, rank):
    got = results["got"][f"meta-{rank}"]
    for calls in got["calls"]:
        assert [c for c in calls if c[0] == "inner"] == []
        reduces = [c for c in calls if c[1] == "all_reduce"]
        # One agreement before the step (3 floats, each rank's timing and units, 2 stop slots), one bucket
        # with every dense gradient (+ the loss).
        assert [(c[0], c[2]) for c in reduces] == [
            ("agree", AGREE),
            ("backward+sync", got["dense_numel"] + 1),
        ]
        forward = [c for c in calls if c[0] == "forward"]
        backward = [c for c in calls if c[0] == "backward+sync" and c[1] != "all_reduce"]
        assert forward and all(c[1] == "all_to_all_single" for c in forward)  # ids out, pooled rows back
        assert [c[1] for c in backward] == ["all_to_all_single"]  # pooled gradients: the pair's return
    assert len(got["calls"]) == META_STEPS
    assert [(c[0], c[1], c[2]) for c in got["tail"]] == [("agree", "all_reduce", AGREE)]  # out of data: stop


def test_killed_rank_fails_the_other_with_a_clear_message(results):
    assert results["exitcodes"][1] == 17
    got = results["got"]["kill-0"]
    assert got["error"] is not None and got["error"].startswith("CollectiveError")
    assert "rank 0 of 2" in got["error"] and "peer rank" in got["error"]
    assert got["seconds"] < KILL_TIMEOUT_S
