"""The whole-step CUDA graph on CUDA (``pytest -m gpu``; skipped without a GPU): the capture
holds the preparation, Triton lookup, head, backward with the fused sparse update and the
fused dense Adam step; replays train what eager steps train (with rates that change every
step too), never wait for the host, and the trainer runs, checkpoints and resumes with them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import TrainConfig, load_config
from recaccel.io.convert.synth import generate_synthetic
from recaccel.ops.embedding import InvalidIdError
from recaccel.train.loop import step as step_module
from recaccel.train.loop.parallel import SingleProcess
from recaccel.train.loop.schedule import set_group_rates
from recaccel.train.loop.step_graph import WARMUP_STEPS, GraphedStep
from recaccel.train.model.optim import build_dense_optimizer
from tests.helpers.step_parts import CARDS, ONE_HOT, one_hot_batch, random_batch, tiny_objective

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


@pytest.fixture
def graphed_runners(monkeypatch) -> list[GraphedStep]:
    """Every GraphedStep the trainer's loop builds in the test."""
    made: list[GraphedStep] = []

    class Recorded(GraphedStep):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(step_module, "GraphedStep", Recorded)
    return made


def _train(train: TrainConfig, batches, *, grad_clip: float = 0.0, dense: str = "adam"):
    objective = tiny_objective(backend="triton", sparse_optim="rowwise_adagrad", device="cuda")
    objective.cfg.optim.grad_clip_norm = grad_clip
    objective.cfg.optim.dense = dense
    optimizer = build_dense_optimizer(
        objective.module, objective.cfg.optim
    )  # fused Adam / SGD, foreach Adagrad
    layout = SingleProcess(CUDA)
    source = [(b.to(CUDA), {"s": i}) for i, b in enumerate(batches)]
    losses = [float(done.loss) for done in layout.steps(source, objective, optimizer, train)]
    state = {k: v.detach().cpu().clone() for k, v in objective.module.state_dict().items()}
    steps = sorted(float(s["step"]) for s in optimizer.state.values() if "step" in s)
    return losses, state, steps


@pytest.mark.parametrize(
    ("pipeline", "grad_clip", "dense"),
    [("off", 0.0, "adam"), ("sync", 0.5, "adam"), ("sync", 0.0, "sgd"), ("off", 0.0, "adagrad")],
)
def test_replayed_steps_train_what_eager_steps_train(graphed_runners, pipeline, grad_clip, dense):
    batches = [one_hot_batch(256, s) for s in range(WARMUP_STEPS + 5)]
    eager, eager_state, eager_steps = _train(
        TrainConfig(pipeline=pipeline), batches, grad_clip=grad_clip, dense=dense
    )
    train = TrainConfig(pipeline=pipeline, cuda_graphs=True, cuda_graph_scope="step")
    graphed, graphed_state, graphed_steps = _train(train, batches, grad_clip=grad_clip, dense=dense)
    assert graphed_steps == eager_steps  # host (Adagrad) and device (fused Adam) step counts alike
    (runner,) = graphed_runners
    assert runner.failed is None, runner.failed
    assert (runner.eager_steps, runner.graphed_steps) == (WARMUP_STEPS, 5)
    # The same kernels in the same order: equal up to the capturable fused Adam's rounding.
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    for key in eager_state:
        torch.testing.assert_close(graphed_state[key], eager_state[key], rtol=1e-4, atol=1e-6, msg=key)


def _scheduled(train: TrainConfig, batches) -> tuple[list[float], dict]:
    """Steps whose dense and sparse rates change before every step, as the trainer's
    schedule sets them (between the loop's steps)."""
    objective = tiny_objective(backend="triton", sparse_optim="rowwise_adagrad", device="cuda")
    optimizer = build_dense_optimizer(objective.module, objective.cfg.optim)  # fused Adam
    steps = SingleProcess(CUDA).steps([(b.to(CUDA), {}) for b in batches], objective, optimizer, train)
    losses = []
    for k in range(len(batches)):
        set_group_rates(optimizer, 0.01 * (k + 1))
        objective.embedding.set_learning_rate(0.05 * (k + 1))
        losses.append(float(next(steps).loss))
    state = {k: v.detach().cpu().clone() for k, v in objective.module.state_dict().items()}
    return losses, state


def test_replays_read_each_steps_learning_rates(graphed_runners):
    batches = [one_hot_batch(256, s) for s in range(WARMUP_STEPS + 5)]
    eager, eager_state = _scheduled(TrainConfig(), batches)
    graphed, graphed_state = _scheduled(TrainConfig(cuda_graphs=True, cuda_graph_scope="step"), batches)
    assert graphed_runners[0].graphed_steps == 5
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    for key in eager_state:
        torch.testing.assert_close(graphed_state[key], eager_state[key], rtol=1e-4, atol=1e-6, msg=key)


def test_other_batches_run_eagerly_between_replays(graphed_runners):
    batches = [one_hot_batch(256, s) for s in range(WARMUP_STEPS + 2)]
    batches += [one_hot_batch(100, 50), random_batch(256, 51), one_hot_batch(256, 52)]
    eager, _, _ = _train(TrainConfig(), batches)
    graphed, _, _ = _train(TrainConfig(cuda_graphs=True, cuda_graph_scope="step"), batches)
    (runner,) = graphed_runners
    assert (runner.eager_steps, runner.graphed_steps) == (WARMUP_STEPS + 2, 3)
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=1e-6)


def test_replays_never_wait_for_the_host(graphed_runners):
    batches = [one_hot_batch(256, s).to(CUDA) for s in range(WARMUP_STEPS + 4)]
    objective = tiny_objective(backend="triton", sparse_optim="rowwise_adagrad", device="cuda")
    optimizer = build_dense_optimizer(objective.module, objective.cfg.optim)
    layout = SingleProcess(CUDA)
    train = TrainConfig(cuda_graphs=True, cuda_graph_scope="step")
    steps = layout.steps([(b, {}) for b in batches], objective, optimizer, train)
    for _ in range(WARMUP_STEPS + 1):  # warm-up and the capture
        next(steps)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replayed = [done.loss for done in steps]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(replayed) == 3 and graphed_runners[0].graphed_steps == 4


def test_a_bad_id_in_a_replayed_step_raises_naming_its_own_batch(graphed_runners):
    batches = [one_hot_batch(64, s) for s in range(WARMUP_STEPS + 1)]
    batches += [one_hot_batch(64, 90, bad=5), one_hot_batch(64, 91), one_hot_batch(64, 92)]
    with pytest.raises(InvalidIdError) as raised:
        _train(TrainConfig(cuda_graphs=True, cuda_graph_scope="step"), batches)
    assert graphed_runners[0].graphed_steps >= 1
    text = str(raised.value)
    assert "sparse_1" in text and str(CARDS[1] + 3) in text and "row 5" in text


# ------------------------------------------------------------------ the trainer


def _run(root: Path, out: Path, *extra: str) -> dict:
    sets = [*ONE_HOT, f'data.train="{root / "train"}"', f'data.test="{root / "test"}"']
    sets += [f'train.out_dir="{out}"', *extra]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    return json.loads((out / "metrics.json").read_text())


def test_the_trainer_trains_checkpoints_and_resumes_with_a_whole_step_graph(graphed_runners, tmp_path):
    root = tmp_path / "data"
    generate_synthetic(load_config(None, [*ONE_HOT, f'synth.out_dir="{root}"']).synth)
    graphs = ["train.cuda_graphs=true", 'train.cuda_graph_scope="step"', 'train.pipeline="sync"']
    eager = _run(root, tmp_path / "eager")
    full = _run(root, tmp_path / "full", *graphs)
    assert graphed_runners and graphed_runners[0].failed is None
    assert sum(r.graphed_steps for r in graphed_runners) > 0
    assert full["steps"] == eager["steps"] == 2 * (2048 // 128)
    assert full["graph_capture"] == "ok" and full["graphed_steps"] > 0
    assert math.isclose(full["train_loss"], eager["train_loss"], rel_tol=1e-4)
    part = tmp_path / "part"
    _run(root, part, *graphs, "train.steps=20")  # stops mid-epoch 2, after a checkpoint at 16
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    resumed = json.loads((part / "metrics.json").read_text())
    assert resumed["steps"] == full["steps"]
    assert math.isclose(resumed["train_loss"], full["train_loss"], rel_tol=1e-4)
