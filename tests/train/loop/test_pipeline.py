"""The pipelined training step (train.pipeline, train.micro_batches) against the plain one.

``sync`` must train exactly what ``off`` trains (bit for bit on CPU), resume exactly, and
pair each step with its own batch's reader position although it has read further;
``semi_sync`` must look the next batch up before this step's sparse update; micro-batches
must give the one-batch step's parameters within float tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import TrainConfig
from recaccel.errors import ConfigError
from recaccel.sparse import Batch
from recaccel.train.loop.pipeline import BatchPipeline, StepInput
from recaccel.train.loop.step import MicroBatchStep, PlainStep, SemiSyncStep, build_step, part_bounds
from recaccel.train.model.objectives import DLRMObjective
from tests.helpers.resume import STEPS_PER_EPOCH, assert_same_run, meta_sets, small_sets
from tests.helpers.step_parts import random_batch, tiny_objective

pytestmark = pytest.mark.numeric


# ----------------------------------------------------------------- the pipeline


@pytest.mark.parametrize("ahead", [0, 2])
@pytest.mark.parametrize("mode", ["off", "sync", "semi_sync"])
def test_each_item_carries_its_own_reader_position(mode, ahead):
    source = [(f"b{i}", {"pos": i}) for i in range(5)]
    taken = []

    def pairs():
        for pair in source:
            taken.append(pair[0])
            yield pair

    lookahead = max(ahead, 1 if mode == "semi_sync" else 0)
    items = []
    for item in BatchPipeline(lambda b: b + "'", torch.device("cpu"), mode, ahead)(pairs()):
        # The pipeline has taken `lookahead` batches more than it has handed out.
        assert len(taken) == min(len(source), len(items) + 1 + lookahead)
        items.append(item)
    assert [(i.batch, i.reader_state["pos"]) for i in items] == [(f"b{i}'", i) for i in range(5)]
    following = [i.following for i in items]
    assert following == (["b1'", "b2'", "b3'", "b4'", None] if mode == "semi_sync" else [None] * 5)


def test_part_bounds_cover_the_rows_in_near_equal_parts():
    assert part_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert part_bounds(3, 4) == [(0, 1), (1, 2), (2, 3)]
    assert part_bounds(1, 1) == [(0, 1)]
    for rows in range(0, 40):
        for parts in range(1, 6):
            bounds = part_bounds(rows, parts)
            assert sum(hi - lo for lo, hi in bounds) == rows
            assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))


# ------------------------------------------------------------- a small model


def _train(objective: DLRMObjective, runner, batches: list[Batch], mode: str = "off") -> list[float]:
    optimizer = torch.optim.SGD(objective.module.parameters(), lr=0.1)
    losses = []
    pipeline = BatchPipeline(objective.prepare, torch.device("cpu"), mode)
    for item in pipeline((b, {}) for b in batches):
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(runner.forward_backward(item)))
        optimizer.step()
    return losses


def _state(objective: DLRMObjective) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in objective.module.state_dict().items()}


def test_semi_sync_looks_the_next_batch_up_before_this_steps_sparse_update():
    objective = tiny_objective()
    b0, b1 = random_batch(6, 1), random_batch(6, 2)
    with torch.no_grad():
        expected = objective.embed(objective.prepare(b1)).clone()  # the rows before any update
    runner = SemiSyncStep(objective, torch.device("cpu"))
    optimizer = torch.optim.SGD(objective.module.parameters(), lr=0.1)
    runner.forward_backward(StepInput(objective.prepare(b0), objective.prepare(b1), {}))
    optimizer.step()
    with torch.no_grad():
        fresh = objective.embed(objective.prepare(b1))
    assert not torch.equal(fresh, expected)  # step 0 updated rows that batch 1 reads
    torch.testing.assert_close(runner._carried.detach(), expected, rtol=0, atol=0)


def test_semi_sync_step_applies_the_stale_lookups_gradient():
    # Two batches: semi-sync's second step pools batch 1 from the initial rows; the
    # update it applies is the gradient of that stale lookup, to the rows as they are.
    objective = tiny_objective()
    b0, b1 = random_batch(5, 3), random_batch(5, 4)
    losses = _train(objective, SemiSyncStep(objective, torch.device("cpu")), [b0, b1], "semi_sync")
    plain = tiny_objective()
    plain_losses = _train(plain, PlainStep(plain), [b0, b1])
    assert losses[0] == plain_losses[0]  # the first step is not stale
    assert losses[1] != plain_losses[1]
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("parts", [2, 3, 6])
@pytest.mark.parametrize("sparse_optim", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weights", [False, True])
def test_micro_batches_give_the_one_batch_step(parts, sparse_optim, weights):
    batches = [random_batch(6, s, weights) for s in range(3)]
    one = tiny_objective(sparse_optim=sparse_optim)
    many = tiny_objective(sparse_optim=sparse_optim)
    l1 = _train(one, PlainStep(one), batches)
    lk = _train(many, MicroBatchStep(many, parts, torch.device("cpu")), batches)
    torch.testing.assert_close(torch.tensor(lk), torch.tensor(l1), rtol=1e-5, atol=1e-6)
    a, b = _state(one), _state(many)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


def test_micro_batches_of_a_batch_of_one_row():
    one, many = tiny_objective(), tiny_objective()
    batch = [random_batch(1, 9)]
    _train(one, PlainStep(one), batch)
    _train(many, MicroBatchStep(many, 4, torch.device("cpu")), batch)
    for key, value in _state(one).items():
        torch.testing.assert_close(_state(many)[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_micro_batches_refuse_an_embedding_that_cannot_defer_its_update():
    objective = tiny_objective(backend="per_table")
    with pytest.raises(ConfigError, match=r"^train.micro_batches=2 needs recaccel's packed embedding") as e:
        build_step(TrainConfig(micro_batches=2), objective, torch.device("cpu"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "sets, message",
    [
        (dict(mode="meta", pipeline="semi_sync"), r"train.pipeline=semi_sync runs train.mode=dlrm"),
        (dict(mode="meta", micro_batches=2), r"train.micro_batches=2 runs train.mode=dlrm"),
        (dict(pipeline="semi_sync", micro_batches=2), r"do not combine"),
    ],
)
def test_pipeline_options_that_do_not_combine_are_one_line(sets, message):
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig(**sets)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------ whole runs (CLI)


def test_sync_pipeline_trains_bit_identical_to_off(small_data, full_run, tmp_path):  # noqa: F811
    run = tmp_path / "sync"
    sets = small_sets(small_data, run, f"train.checkpoint_every={STEPS_PER_EPOCH}", "train.pipeline=sync")
    assert train_main(sets) == 0
    assert_same_run(full_run, run)


def test_sync_pipeline_resumes_exactly(small_data, full_run, tmp_path):  # noqa: F811
    run = tmp_path / "part"
    stop = STEPS_PER_EPOCH + 3  # mid-epoch: the pipeline had taken the next batch
    extra = (f"train.checkpoint_every={STEPS_PER_EPOCH}", "train.pipeline=sync", f"train.steps={stop}")
    assert train_main(small_sets(small_data, run, *extra)) == 0
    assert train_main(["--resume", str(run), "--set", "train.steps=0"]) == 0
    assert_same_run(full_run, run)


def _data_counters(run: Path) -> dict:
    metrics = json.loads((run / "metrics.json").read_text())
    return {k: metrics[k] for k in ("steps", "epochs", "train_samples", "data")}


def test_semi_sync_resumed_trains_every_row_once(small_data, tmp_path):  # noqa: F811
    full, part = tmp_path / "full", tmp_path / "part"
    extra = (f"train.checkpoint_every={STEPS_PER_EPOCH}", "train.pipeline=semi_sync")
    assert train_main(small_sets(small_data, full, *extra)) == 0
    assert train_main(small_sets(small_data, part, *extra, "train.steps=5")) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    assert _data_counters(part) == _data_counters(full)
    a = json.loads((full / "metrics.json").read_text())
    assert 0.0 < a["train_loss"] < 1.0 and a["auc"] > 0.5


def test_meta_sync_pipeline_trains_bit_identical_to_off(task_data, tmp_path):  # noqa: F811
    train, test = task_data
    off, sync = tmp_path / "off", tmp_path / "sync"
    assert train_main(meta_sets(train, test, off)) == 0
    assert train_main(meta_sets(train, test, sync, "train.pipeline=sync")) == 0
    assert_same_run(off, sync, measured=("max_buffered_rows", "rows_read", "row_groups_read"))


def test_micro_batches_train_from_the_cli_close_to_one_batch(small_data, full_run, tmp_path):  # noqa: F811
    run = tmp_path / "micro"
    assert (
        train_main(
            small_sets(small_data, run, f"train.checkpoint_every={STEPS_PER_EPOCH}", "train.micro_batches=4")
        )
        == 0
    )
    a = json.loads((full_run / "metrics.json").read_text())
    b = json.loads((run / "metrics.json").read_text())
    assert a["steps"] == b["steps"] and a["train_samples"] == b["train_samples"]
    assert b["auc"] == pytest.approx(a["auc"], abs=2e-3)
    assert b["train_loss"] == pytest.approx(a["train_loss"], abs=2e-3)
