"""Hybrid training through TorchRec's train pipelines on 2 CPU processes (gloo).

One pair of worker processes runs every check in turn: the same hybrid DLRM run with
``train.pipeline`` off and sync (``TrainPipelineSparseDist``), each evaluating mid-run
(the pipeline is detached and re-attached) and recording every step's loss and reader
position; a sync run stopped after a checkpoint and resumed; and the one-line errors
of setups the pipeline does not run (semi_sync on CPU among them). On a GPU, one NCCL
rank runs off, sync and semi_sync (``TrainPipelineSemiSync``).
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec", exc_type=ImportError)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from recaccel.config import load_config  # noqa: E402
from recaccel.io.convert.synth import generate_synthetic  # noqa: E402
from tests.helpers.hybrid_run import SHARDED_TINY, WORLD, free_port, sharded_overrides  # noqa: E402

STEPS = 12  # an epoch is 23 steps: the run stops mid-epoch with batches in flight
# Row-wise tables plus one replicated table: input all-to-all, reduce-scatter, dense sync of a table.
SHARDING = ["parallel.sharding=row_wise", 'parallel.table_sharding=["C4=data_parallel"]']
EVAL_EVERY = 5
MODES = ("off", "sync")


def _trainer(root: Path, name: str, *extra: str):
    from recaccel.train.loop.trainer import Trainer

    overrides = sharded_overrides(root / "data", root / name, "parallel.mode=hybrid", *SHARDING, *extra)
    return load_config(None, overrides), Trainer


def _errors(root: Path, cases: dict[str, list[str]]) -> dict[str, str | None]:
    """Each case's ConfigError message (None when it trained)."""
    from recaccel.errors import ConfigError

    out = {}
    for name, extra in cases.items():
        cfg, make = _trainer(root, f"err_{name}", *extra)
        try:
            make(cfg).fit()
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    return out


def _recording(trainer) -> list[tuple[float, dict]]:
    """Wraps the trainer's ``parallel.steps`` to record each step's (loss, reader state)."""
    seen: list[tuple[float, dict]] = []
    steps = trainer.parallel.steps

    def recorded(*args, **kwargs):
        for done in steps(*args, **kwargs):
            seen.append((float(done.loss), done.reader_state))
            yield done

    trainer.parallel.steps = recorded
    return seen


def _job_mode(rank: int, root: Path, mode: str, *extra: str) -> dict:
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist

    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict

    cfg, make = _trainer(root, mode, f"train.pipeline={mode}", f"train.eval_every={EVAL_EVERY}", *extra)
    trainer = make(cfg)
    seen = _recording(trainer)
    progress = TrainPipelineSparseDist.progress
    steps: list[tuple[list[str], int]] = []  # per pipelined step: forwards of its modules, batches held

    def observed(self, it):
        out = progress(self, it)
        steps.append(([type(m.forward).__name__ for m in self._pipelined_modules], len(self.batches)))
        return out

    TrainPipelineSparseDist.progress = observed  # TrainPipelineSemiSync's calls its own
    try:
        metrics = trainer.fit()
    finally:
        TrainPipelineSparseDist.progress = progress
    state = consolidated_state_dict(trainer.parallel, trainer.objective.module)
    return {"metrics": metrics, "state": state, "seen": seen, "pipelined": steps}


def _job_resume(rank: int, root: Path) -> dict:
    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict

    cfg, make = _trainer(
        root, "resumed", "train.pipeline=sync", f"train.eval_every={EVAL_EVERY}", "train.steps=5"
    )
    make(cfg).fit()
    cfg, make = _trainer(root, "resumed", "train.pipeline=sync", f"train.eval_every={EVAL_EVERY}")
    trainer = make(cfg, resume=True)
    seen = _recording(trainer)
    metrics = trainer.fit()
    state = consolidated_state_dict(trainer.parallel, trainer.objective.module)
    return {"metrics": metrics, "state": state, "seen": seen}


def _job_errors(rank: int, root: Path) -> dict:
    tables = ",".join(f'"C{i}=data_parallel"' for i in range(1, 5))
    return _errors(
        root,
        {
            "semi_sync_cpu": ["train.pipeline=semi_sync"],
            "all_replicated": ["train.pipeline=sync", f"parallel.table_sharding=[{tables}]"],
        },
    )


def _worker(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    root = Path(root)
    jobs = [(f"mode_{m}", lambda r, p, m=m: _job_mode(r, p, m)) for m in MODES]
    jobs += [("resume", _job_resume), ("errors", _job_errors)]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=60),
        )
        for name, job in jobs:
            torch.save(job(rank, root), root / f"{name}-{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (root / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_pipeline")
    generate_synthetic(load_config(None, [*SHARDED_TINY, f'synth.out_dir="{root / "data"}"']).synth)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(root))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [f.read_text() for f in sorted(root.glob("error-*.txt"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * WORLD
    return {f.stem: torch.load(f, weights_only=False) for f in root.glob("*-*.pt")}


def _assert_states_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


def test_sync_pipeline_equals_the_unpipelined_hybrid_run(results):
    off, sync = results["mode_off-0"], results["mode_sync-0"]
    _assert_states_equal(sync["state"], off["state"])  # the whole model, sharded tables gathered
    for key in ("auc", "logloss", "train_loss", "steps", "train_samples"):
        assert sync["metrics"][key] == off["metrics"][key], key
    assert off["metrics"]["steps"] == STEPS
    for rank in range(WORLD):  # every step's global loss, on every rank
        assert results[f"mode_sync-{rank}"]["seen"] == results[f"mode_off-{rank}"]["seen"]


def test_sync_runs_torchrec_pipeline_with_batches_in_flight(results):
    pipelined = results["mode_sync-0"]["pipelined"]
    assert len(pipelined) == STEPS and results["mode_off-0"]["pipelined"] == []
    # The sharded collection runs TorchRec's pipelined forward; after each step the
    # pipeline holds batch i+1 (input all-to-all done) and i+2 (taken from the loader).
    assert all(forwards == ["PipelinedForward"] for forwards, _ in pipelined)
    assert [held for _, held in pipelined] == [2] * STEPS


def test_each_step_reports_the_reader_position_of_its_own_batch(results):
    off, sync = results["mode_off-0"], results["mode_sync-0"]
    states = [state for _, state in sync["seen"]]
    assert states == [state for _, state in off["seen"]]
    assert len(states) == STEPS and len({repr(s) for s in states}) == STEPS


def test_resume_with_the_sync_pipeline_matches_the_uninterrupted_run(results):
    resumed, straight = results["resume-0"], results["mode_off-0"]
    _assert_states_equal(resumed["state"], straight["state"])
    # The resumed run's steps 6..12 read exactly the batches of the straight run's.
    assert resumed["seen"] == straight["seen"][5:]
    assert resumed["metrics"]["train_samples"] == straight["metrics"]["train_samples"]


@pytest.mark.parametrize("case", ["semi_sync_cpu", "all_replicated"])
def test_setups_the_pipeline_cannot_run_are_one_line_config_errors(results, case):
    message = results["errors-0"][case]
    assert message is not None and "\n" not in message
    assert message.startswith(f"train.pipeline={'semi_sync' if case == 'semi_sync_cpu' else 'sync'} ")


# ------------------------------------------------------------------ in-process checks


def test_meta_learning_keeps_the_pipeline_off_in_hybrid_mode():
    from types import SimpleNamespace

    from recaccel.errors import ConfigError
    from recaccel.train.distributed.hybrid_pipeline import check_pipelined

    parallel = SimpleNamespace(dmp=object(), device=torch.device("cpu"))
    with pytest.raises(
        ConfigError, match=r"^train.pipeline=sync in parallel.mode=hybrid runs DLRM row batches"
    ):
        check_pipelined(parallel, SimpleNamespace(loss="bce"), "sync")


def test_pipelined_batch_moves_its_tensors_and_keeps_its_step_record():
    from recaccel.sparse import Batch, SparseFeatures
    from recaccel.train.distributed.hybrid_pipeline import PipelinedBatch

    sparse = SparseFeatures.from_lengths(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 2, 0]))
    batch = Batch(torch.randn(2, 3), sparse, torch.tensor([0.0, 1.0]))
    item = PipelinedBatch(batch, sparse.to_kjt(), 4.0, 4, {"pos": 7})
    moved = item.to(torch.device("cpu"), non_blocking=True)
    assert (moved.denominator, moved.rows, moved.reader_state) == (4.0, 4, {"pos": 7})
    assert torch.equal(moved.kjt.values(), sparse.values) and moved.batch.sparse.keys == ["a", "b"]
    item.record_stream(torch.cpu.current_stream())  # a CPU stream: nothing to mark


# ------------------------------------------------------------------ GPU: one NCCL rank


def _gpu_worker(port: int, root: str) -> None:
    root = Path(root)
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        for mode in ("off", "sync", "semi_sync"):
            got = _job_mode(0, root, mode, "train.device=cuda")
            got["state"] = {k: v.cpu() for k, v in got["state"].items()}
            torch.save(got, root / f"gpu_{mode}.pt")
        dist.destroy_process_group()
    except BaseException:
        (root / "error.txt").write_text(traceback.format_exc())
        os._exit(1)


@pytest.mark.gpu
def test_gpu_sync_equals_off_and_semi_sync_trains(tmp_path):
    generate_synthetic(load_config(None, [*SHARDED_TINY, f'synth.out_dir="{tmp_path / "data"}"']).synth)
    proc = mp.get_context("spawn").Process(target=_gpu_worker, args=(free_port(), str(tmp_path)))
    proc.start()
    proc.join(300)
    if proc.is_alive():
        proc.kill()
    assert not (tmp_path / "error.txt").exists(), (tmp_path / "error.txt").read_text()
    off, sync, semi = (
        torch.load(tmp_path / f"gpu_{m}.pt", weights_only=False) for m in MODES + ("semi_sync",)
    )
    assert sorted(sync["state"]) == sorted(off["state"])
    for key, value in off["state"].items():
        torch.testing.assert_close(
            sync["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert [s for _, s in sync["seen"]] == [s for _, s in off["seen"]] == [s for _, s in semi["seen"]]
    losses, ref = [loss for loss, _ in semi["seen"]], [loss for loss, _ in off["seen"]]
    # Step 2's lookup runs before step 1's sparse update: stale rows, another loss.
    assert abs(losses[0] - ref[0]) < 1e-6 and losses[1] != ref[1]
    assert semi["metrics"]["steps"] == STEPS
