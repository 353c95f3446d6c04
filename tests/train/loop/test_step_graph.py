"""The whole-step CUDA graph (train.cuda_graph_scope = "step") on CPU, with a capture that
replays by running the captured body again: the static-batch plumbing, the warm-up, the
fallbacks and the host work a replay does not redo, each against plain eager steps
(bit for bit on CPU). The CUDA capture itself: test_step_graph_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch

from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.ops.embedding import InvalidIdError
from recaccel.sparse import Batch, SparseFeatures
from recaccel.train.loop.pipeline import BatchPipeline
from recaccel.train.loop.schedule import set_group_rates
from recaccel.train.loop.step import PlainStep
from recaccel.train.loop.step_graph import GraphedStep, StaticBatch
from recaccel.train.model.optim import build_dense_optimizer
from tests.helpers.step_parts import CARDS, one_hot_batch, random_batch, tiny_objective

pytestmark = pytest.mark.numeric


def replay_by_running(body):
    """A capture that runs nothing now and the body at every replay (CPU stand-in)."""
    return body


def _objective(dense: str = "adam", **kwargs):
    objective = tiny_objective(sparse_optim="rowwise_adagrad", **kwargs)
    objective.cfg.optim.dense = dense
    optimizer = build_dense_optimizer(objective.module, objective.cfg.optim)
    return objective, optimizer


def _run(objective, optimizer, runner, batches: list[Batch]) -> list[torch.Tensor]:
    prepare = (lambda b: b) if runner.prepares_in_step else objective.prepare
    pipeline = BatchPipeline(prepare, torch.device("cpu"), "off")
    return [runner.train_step(item, optimizer) for item in pipeline((b, {}) for b in batches)]


def _same_training(
    batches: list[Batch], dense: str = "adam", train: dict | None = None, **graphed
) -> tuple[GraphedStep, list, list]:
    """Trains two copies of the tiny model (``train``: TrainConfig fields) on ``batches``:
    plain eager steps and a graphed step (replays by running the body); asserts equal
    losses and final states (the dense optimizer's step counts included)."""
    plain_obj, plain_opt = _objective(dense, **(train or {}))
    graph_obj, graph_opt = _objective(dense, **(train or {}))
    runner = GraphedStep(graph_obj, torch.device("cpu"), capture=replay_by_running, **graphed)
    plain = _run(plain_obj, plain_opt, PlainStep(plain_obj), batches)
    graph = _run(graph_obj, graph_opt, runner, batches)
    torch.testing.assert_close(torch.stack(graph), torch.stack(plain), rtol=0, atol=0)
    for (name, a), b in zip(graph_obj.module.state_dict().items(), plain_obj.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(
        graph_opt.state_dict()["state"], plain_opt.state_dict()["state"], rtol=0, atol=0
    )
    return runner, graph, plain


@pytest.mark.parametrize("dense", ["adam", "sgd", "adagrad"])
def test_a_graphed_run_trains_what_plain_steps_train(dense):
    batches = [one_hot_batch(16, seed) for seed in range(7)]
    runner, _, _ = _same_training(batches, dense, warmup_steps=2)
    assert runner.captured and runner.failed is None
    assert (runner.eager_steps, runner.graphed_steps, runner.steps) == (2, 5, 7)


def test_a_graphed_bf16_run_trains_what_plain_bf16_steps_train():
    """The captured body enters and leaves the objective's autocast itself (no cast cached
    across a replay): bf16 replays train what bf16 eager steps train, bit for bit."""
    batches = [one_hot_batch(16, seed) for seed in range(5)]
    runner, graph, _ = _same_training(batches, train={"precision": "bf16"}, warmup_steps=2)
    assert runner.captured and runner.graphed_steps == 3 and all(torch.isfinite(torch.stack(graph)))


def test_replays_read_the_static_copy_refilled_from_each_batch():
    batches = [one_hot_batch(8, seed) for seed in range(4)]
    objective, optimizer = _objective()
    runner = GraphedStep(objective, torch.device("cpu"), capture=replay_by_running, warmup_steps=1)
    _run(objective, optimizer, runner, batches)
    static = runner.static.batch
    last = batches[-1]
    assert static is not last and static.dense.data_ptr() != last.dense.data_ptr()
    torch.testing.assert_close(static.dense, last.dense, rtol=0, atol=0)
    torch.testing.assert_close(static.sparse.values, last.sparse.values, rtol=0, atol=0)


def test_batches_of_another_signature_run_eagerly_and_are_logged_once(caplog):
    batches = [one_hot_batch(16, s) for s in range(4)] + [one_hot_batch(5, 9), one_hot_batch(16, 10)]
    batches += [one_hot_batch(5, 11), random_batch(16, 12)]  # a multi-hot batch: other id counts
    with caplog.at_level(logging.INFO, logger="recaccel.train.loop.step_graph"):
        runner, _, _ = _same_training(batches, warmup_steps=2)
    assert (runner.eager_steps, runner.graphed_steps) == (2 + 3, 3)
    said = [r.message for r in caplog.records if "does not match the captured step" in r.message]
    assert len(said) == 1 and "5 rows" in said[0] and "(16 rows)" in said[0]


def test_a_capture_that_fails_leaves_the_run_eager_and_says_why(caplog):
    def failing(body):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    batches = [one_hot_batch(16, seed) for seed in range(5)]
    plain_obj, plain_opt = _objective()
    graph_obj, graph_opt = _objective()
    runner = GraphedStep(graph_obj, torch.device("cpu"), capture=failing, warmup_steps=1)
    with caplog.at_level(logging.WARNING, logger="recaccel.train.loop.step_graph"):
        graph = _run(graph_obj, graph_opt, runner, batches)
    plain = _run(plain_obj, plain_opt, PlainStep(plain_obj), batches)
    torch.testing.assert_close(torch.stack(graph), torch.stack(plain), rtol=0, atol=0)
    assert not runner.captured and runner.failed.endswith("not permitted when stream is capturing")
    assert (runner.eager_steps, runner.graphed_steps) == (5, 0)
    warned = [r.message for r in caplog.records if "capturing the whole training step failed" in r.message]
    assert len(warned) == 1 and "more detail" not in warned[0]


def test_the_metric_window_sees_every_replayed_step():
    batches = [one_hot_batch(16, seed) for seed in range(5)]
    plain_obj, plain_opt = _objective()
    graph_obj, graph_opt = _objective()
    seen: dict[str, list] = {"plain": [], "graph": []}
    plain_obj.watch = lambda logits, labels: seen["plain"].append((logits.detach().clone(), labels.clone()))
    graph_obj.watch = lambda logits, labels: seen["graph"].append((logits.detach().clone(), labels.clone()))
    runner = GraphedStep(graph_obj, torch.device("cpu"), capture=replay_by_running, warmup_steps=2)
    _run(plain_obj, plain_opt, PlainStep(plain_obj), batches)
    _run(graph_obj, graph_opt, runner, batches)
    assert runner.graphed_steps == 3 and len(seen["graph"]) == len(seen["plain"]) == 5
    for (gl, gy), (pl, py) in zip(seen["graph"], seen["plain"]):
        torch.testing.assert_close(gl, pl, rtol=0, atol=0)
        torch.testing.assert_close(gy, py, rtol=0, atol=0)


def test_the_clipped_gradient_norm_is_the_replayed_steps():
    objective, _ = _objective()
    cfg = objective.cfg
    cfg.optim.grad_clip_norm = 1e-3
    optimizer = build_dense_optimizer(objective.module, cfg.optim)
    runner = GraphedStep(objective, torch.device("cpu"), capture=replay_by_running, warmup_steps=1)
    norms = []
    for item in BatchPipeline(lambda b: b, torch.device("cpu"), "off")(
        (one_hot_batch(16, s), {}) for s in range(4)
    ):
        runner.train_step(item, optimizer)
        norms.append(float(optimizer.grad_norm))
    assert runner.graphed_steps == 3 and len(set(norms)) == 4  # a fresh norm every step


def test_a_bad_id_in_a_replayed_step_raises_naming_its_own_batch():
    objective, optimizer = _objective(backend="triton")  # the deferred bounds check: Triton's kernels count
    runner = GraphedStep(objective, torch.device("cpu"), capture=replay_by_running, warmup_steps=1)
    batches = [one_hot_batch(4, 0), one_hot_batch(4, 1), one_hot_batch(4, 2, bad=3), one_hot_batch(4, 3)]
    items = BatchPipeline(lambda b: b, torch.device("cpu"), "off")((b, {}) for b in batches)
    with pytest.raises(InvalidIdError) as raised:
        for item in items:
            runner.train_step(item, optimizer)
    assert runner.graphed_steps >= 1
    text = str(raised.value)
    assert (
        "sparse_1" in text and str(CARDS[1] + 3) in text and "row 3" in text and len(text.splitlines()) == 1
    )


def test_static_batch_signature_names_what_a_replay_needs():
    a, b = one_hot_batch(8, 0), one_hot_batch(8, 1)
    static = StaticBatch(a)
    assert static.matches(b) and not static.matches(one_hot_batch(9, 0))
    assert not static.matches(random_batch(8, 0))
    moved = Batch(a.dense.double(), a.sparse, a.labels)
    assert not static.matches(moved)


# ------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (['train.pipeline="semi_sync"'], "train.pipeline=semi_sync do not combine"),
        (["train.micro_batches=2"], "train.micro_batches=2 do not combine"),
        (['optim.schedule="cosine"', "optim.decay_steps=10", 'optim.dense="sgd"'], "use optim.dense=adam"),
        (["optim.warmup_steps=5", 'optim.dense="adagrad"'], "use optim.dense=adam"),
        (['optim.sparse="adam"'], "optim.sparse=adam"),
        (['model.embedding_dtype="bf16"'], "model.embedding_dtype=bf16"),
        (['model.embedding_placement="host"'], "host-placed tables"),
        (['model.embedding_backend="reference"'], "model.embedding_backend=reference"),
    ],
)
def test_what_a_captured_step_cannot_replay_is_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["train.cuda_graphs=true", 'train.cuda_graph_scope="step"', *overrides])
    text = str(raised.value)
    assert words in text and len(text.splitlines()) == 1
    load_config(None, ['train.cuda_graph_scope="step"', *overrides])  # no graphs: nothing to refuse


def test_a_step_scope_without_cuda_graphs_is_logged(caplog):
    from recaccel.config import TrainConfig
    from recaccel.train.model.dense_head import check_head_options

    objective = tiny_objective()
    with caplog.at_level(logging.WARNING, logger="recaccel.train.model.dense_head"):
        check_head_options(TrainConfig(cuda_graph_scope="step"), objective.module, torch.device("cpu"))
    assert any("captures nothing with train.cuda_graphs=false" in r.message for r in caplog.records)


def test_a_step_graph_needs_a_packed_fused_embedding_and_cuda():
    objective, _ = _objective()
    with pytest.raises(ConfigError, match=r"needs a CUDA device, not cpu; use train.cuda_graph_scope=head$"):
        GraphedStep(objective, torch.device("cpu"))
    autograd = tiny_objective()
    autograd.embedding.mode = "autograd"  # as a model built in autograd mode reports itself
    with pytest.raises(ConfigError, match="fused update"):
        GraphedStep(autograd, torch.device("cpu"), capture=replay_by_running)


def test_a_captured_runs_checkpoint_loads_into_a_run_without_graphs(tmp_path):
    """A captured step's dense Adam holds its rate in a tensor and is capturable; its
    checkpoints save numbers, which any run loads (the payload check refuses a tensor
    where a rate belongs) at its own configured rate (the schedule sets each step's), and
    a run that does not capture is not capturable."""
    from recaccel.train.checkpoint.state import TrainState, list_checkpoints, load_checkpoint, save_checkpoint
    from recaccel.train.loop.step_graph import hold_rates_in_tensors

    objective, optimizer = _objective()
    _run(objective, optimizer, PlainStep(objective), [one_hot_batch(16, 0)])
    hold_rates_in_tensors(optimizer)
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    set_group_rates(optimizer, 0.0123)
    save_checkpoint(tmp_path, objective.module, optimizer, TrainState(step=1))
    saved = torch.load(list_checkpoints(tmp_path)[-1], weights_only=True)["optimizer"]["param_groups"][0]
    assert saved["lr"] == pytest.approx(0.0123) and isinstance(saved["lr"], float)
    fresh_obj, fresh = _objective()
    configured = fresh.param_groups[0]["lr"]
    load_checkpoint(tmp_path, fresh_obj.module, fresh, torch.device("cpu"))
    group = fresh.param_groups[0]
    assert group["lr"] == configured and isinstance(group["lr"], float)
    assert group["capturable"] is False
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)  # the live group keeps its tensor


def test_the_trainers_loop_keeps_one_graphed_runner_across_its_calls(monkeypatch):
    """SingleProcess.steps is called once per epoch (and per step by the train bench): a
    whole-step graph is captured once per run, and the loop hands it unprepared batches."""
    import functools

    from recaccel.config import TrainConfig
    from recaccel.train.loop import step as step_module
    from recaccel.train.loop.parallel import SingleProcess

    monkeypatch.setattr(
        step_module, "GraphedStep", functools.partial(GraphedStep, capture=replay_by_running, warmup_steps=2)
    )
    batches = [one_hot_batch(16, seed) for seed in range(6)]
    plain_obj, plain_opt = _objective()
    plain = _run(plain_obj, plain_opt, PlainStep(plain_obj), batches)
    objective, optimizer = _objective()
    train = TrainConfig(cuda_graphs=True, cuda_graph_scope="step", pipeline="sync")
    layout = SingleProcess(torch.device("cpu"))
    losses = []
    for part in (batches[:3], batches[3:]):  # two "epochs"
        losses += [done.loss for done in layout.steps([(b, {}) for b in part], objective, optimizer, train)]
    runner = layout._runner(train, objective)  # noqa: SLF001 (the kept runner)
    assert isinstance(runner, GraphedStep) and (runner.eager_steps, runner.graphed_steps) == (2, 4)
    torch.testing.assert_close(torch.stack(losses), torch.stack(plain), rtol=0, atol=0)


def test_the_trainer_with_a_whole_step_runner_trains_and_resumes_exactly(monkeypatch, tmp_path):
    """The trainer's loop, evaluation, checkpoints and resume around a GraphedStep (its
    capture replayed by running the body, on CPU): the runs of eager steps, bit for bit."""
    import json

    from recaccel.cli import train_main
    from recaccel.io.convert.synth import generate_synthetic
    from recaccel.train.loop import setup
    from recaccel.train.loop import step as step_module
    from recaccel.train.model import dense_head
    from tests.helpers.resume import final_entries
    from tests.helpers.step_parts import ONE_HOT

    made = []

    def recorded(*args, **kwargs):
        made.append(GraphedStep(*args, capture=replay_by_running, **kwargs))
        return made[-1]

    monkeypatch.setattr(step_module, "GraphedStep", recorded)
    for module in (dense_head, setup):  # CUDA graphs, on CPU
        monkeypatch.setattr(module, "check_head_options", lambda *args: None)
    sets = [s for s in ONE_HOT if not s.startswith("train.device")] + [
        'train.device="cpu"',
        "train.eval_every=8",
    ]
    root = tmp_path / "data"
    generate_synthetic(load_config(None, [*sets, f'synth.out_dir="{root}"']).synth)

    def run(out, *extra):
        args = [
            *sets,
            f'data.train="{root / "train"}"',
            f'data.test="{root / "test"}"',
            f'train.out_dir="{out}"',
        ]
        assert train_main([a for s in [*args, *extra] for a in ("--set", s)]) == 0
        return json.loads((out / "metrics.json").read_text())

    graphs = ["train.cuda_graphs=true", 'train.cuda_graph_scope="step"', 'train.pipeline="sync"']
    eager = run(tmp_path / "eager")
    full = run(tmp_path / "full", *graphs)
    assert len(made) == 1 and made[0].graphed_steps == full["steps"] - made[0].eager_steps > 0
    assert full["train_loss"] == eager["train_loss"] and full["auc"] == eager["auc"]
    assert (full["graphed_steps"], full["eager_steps"]) == (made[0].graphed_steps, made[0].eager_steps)
    assert full["graph_capture"] == "ok" and "graphed_steps" not in eager
    part = tmp_path / "part"
    run(part, *graphs, "train.steps=20")  # mid-epoch 2, after the checkpoint of step 16
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    resumed = json.loads((part / "metrics.json").read_text())
    assert resumed["train_loss"] == full["train_loss"]
    for (key, a), b in zip(final_entries(tmp_path / "full").items(), final_entries(part).values()):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_host_step_counts_advance_once_per_replay_of_a_real_graph():
    """A CUDA replay runs none of the step's host work: Adagrad's CPU step counts stay where
    the capture left them (the capture ran the host part once: undone) unless advanced here."""
    objective, optimizer = _objective("adagrad")
    batches = [one_hot_batch(16, seed) for seed in range(5)]
    captured = {}

    def like_a_graph(body):
        """Runs the body at capture (its host part: what a real capture runs) and replays
        its tensor work by rerunning it with the host step counts held still."""
        captured["body"] = body
        body()

        def replay():
            counts = [s["step"] for s in optimizer.state.values()]
            held = [c.clone() for c in counts]
            body()
            for c, h in zip(counts, held):
                c.copy_(h)

        return replay

    runner = GraphedStep(objective, torch.device("cpu"), capture=like_a_graph, warmup_steps=2)
    _run(objective, optimizer, runner, batches)
    assert runner.graphed_steps == 3
    assert {float(s["step"]) for s in optimizer.state.values()} == {5.0}


def test_the_capture_waits_for_a_warmed_up_batch_of_its_own_kind():
    """A run (or a resume) that starts on a short batch captures a full one, after full
    batches have warmed the kernels up, not the short one."""
    batches = [one_hot_batch(5, 0), one_hot_batch(16, 1), one_hot_batch(16, 2), one_hot_batch(16, 3)]
    batches += [one_hot_batch(16, s) for s in range(4, 7)]
    runner, _, _ = _same_training(batches, warmup_steps=2)
    assert runner.static.batch.batch_size == 16
    assert (runner.eager_steps, runner.graphed_steps) == (3, 4)


def test_an_objective_whose_update_a_replay_cannot_repeat_is_refused():
    adam = tiny_objective(sparse_optim="adam")
    with pytest.raises(ConfigError, match="not adam"):
        GraphedStep(adam, torch.device("cpu"), capture=replay_by_running)
    objective, _ = _objective()
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        GraphedStep(objective, torch.device("cpu"), capture=replay_by_running, warmup_steps=0)


def test_the_packs_update_counts_advance_once_per_replayed_step():
    objective, optimizer = _objective()
    held = {}

    def like_a_graph(body):
        body()  # the host part runs at capture (undone by GraphedStep)

        def replay():  # the tensor work again; the host's counters stay where they were
            counts = objective.embedding.step_counts()
            held["before"] = [c.clone() for c in counts]
            body()
            for c, h in zip(counts, held["before"]):
                c.copy_(h)

        return replay

    runner = GraphedStep(objective, torch.device("cpu"), capture=like_a_graph, warmup_steps=1)
    _run(objective, optimizer, runner, [one_hot_batch(16, s) for s in range(4)])
    assert runner.graphed_steps == 3
    assert [int(c) for c in objective.embedding.step_counts()] == [4]


def test_batches_that_never_repeat_a_signature_give_up_the_capture_and_say_so(caplog):
    """Multi-hot bags of a varying total length: no signature repeats; after a bounded number
    of kinds the warm-up stops tracking them, logs once, and the run is eager."""
    from recaccel.train.loop.step_graph import MAX_SIGNATURES

    def varying(seed: int) -> Batch:  # field sparse_1's first bag holds 1 + seed ids
        g = torch.Generator().manual_seed(seed)
        lengths = torch.ones(3 * 16, dtype=torch.int64)
        lengths[16] += seed
        values = torch.cat([torch.randint(0, c, (int(lengths[f * 16 : (f + 1) * 16].sum()),), generator=g)
                            for f, c in enumerate(CARDS)])  # fmt: skip
        sparse = SparseFeatures.from_lengths(["sparse_0", "sparse_1", "sparse_2"], values, lengths)
        return Batch(torch.randn(16, 3, generator=g), sparse, torch.randint(0, 2, (16,), generator=g).float())

    batches = [varying(seed) for seed in range(MAX_SIGNATURES + 4)]
    with caplog.at_level(logging.WARNING, logger="recaccel.train.loop.step_graph"):
        runner, _, _ = _same_training(batches, warmup_steps=2)
    assert not runner.captured and runner.failed.startswith("no batch signature repeated 2 times")
    assert runner.eager_steps == len(batches) and not runner._warm  # noqa: SLF001 (bounded)
    said = [r.message for r in caplog.records if "is not captured" in r.message]
    assert len(said) == 1
