"""train.precision = "bf16" in meta mode: the MAML step under bfloat16 autocast, in every
engine and order, close to float32; and a meta run through the CLI that lands near fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import MetaConfig
from recaccel.io.convert.group_by_task import group_by_task
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.meta.learner import MetaLearner
from tests.helpers.meta_batches import make_dlrm, make_task_batch


def _step(precision: str, engine: str, first_order: bool, meta_sgd: bool) -> tuple[float, list, torch.Tensor]:
    """One meta step of a fresh float32 DLRM: (loss, meta-parameter gradients, adapted query predictions)."""
    model = make_dlrm(dtype=torch.float32, seed=3)
    cfg = MetaConfig(inner_steps=2, inner_lr=0.1, first_order=first_order, meta_sgd=meta_sgd)
    learner = MetaLearner(model, cfg, loss="bce", engine=engine, precision=precision)
    tb = make_task_batch(5, 6, 4, seed=2)
    loss, _ = learner.step_loss(tb)
    assert loss.dtype == torch.float32
    loss.backward()
    grads = [p.grad.clone() for p in learner.meta_parameters()]
    assert all(g.dtype == torch.float32 for g in grads)  # parameters and gradients stay float32
    pred = learner.adapt_and_predict(tb)
    assert pred.dtype == torch.float32
    return float(loss.detach()), grads, pred


@pytest.mark.parametrize("engine", ["batched", "vmap", "loop"])
@pytest.mark.parametrize("first_order", [True, False])
def test_bf16_meta_step_runs_in_bfloat16_and_stays_close_to_fp32(engine, first_order):
    loss32, grads32, pred32 = _step("fp32", engine, first_order, meta_sgd=True)
    loss16, grads16, pred16 = _step("bf16", engine, first_order, meta_sgd=True)
    # bfloat16 has an 8-bit mantissa: the step differs from fp32 (autocast is on) ...
    assert not torch.equal(pred16, pred32)
    # ... by about its rounding, not more.
    assert loss16 == pytest.approx(loss32, rel=2e-2, abs=2e-2)
    torch.testing.assert_close(pred16, pred32, rtol=5e-2, atol=5e-2)
    flat32 = torch.cat([g.flatten() for g in grads32])
    flat16 = torch.cat([g.flatten() for g in grads16])
    assert torch.nn.functional.cosine_similarity(flat16, flat32, dim=0) > 0.98


def _ratings(out: Path, users: range, seed: int) -> Path:
    """Task-grouped ratings with a per-user offset that adapting on the support rows fits."""
    rng = np.random.default_rng(seed)
    per_user = rng.integers(12, 30, len(users))
    user = np.repeat(np.array(users), per_user)
    offset = (np.array(users) % 5 - 2.0)[np.repeat(np.arange(len(users)), per_user)]
    schema = FeatureSchema(
        dense=("d0",), sparse=(SparseField("user", 64), SparseField("item", 40)), label_kind="rating"
    )
    cols = {
        "label": (3.0 + offset + rng.normal(0, 0.3, user.size)).astype(np.float32),
        "d0": rng.normal(size=user.size).astype(np.float32),
        "user": user,
        "item": rng.integers(0, 40, user.size),
    }
    write_parquet(out / "raw", schema, cols, rows_per_row_group=100)
    group_by_task(out / "raw", out / "grouped", task_key="user", rows_per_row_group=100)
    return out / "grouped"


def _train(train: Path, test: Path, out: Path, precision: str) -> dict:
    sets = [
        f'data.train="{train}"',
        f'data.test="{test}"',
        f'train.out_dir="{out}"',
        "train.progress=false",
        "train.mode=meta",
        "train.steps=30",
        f"train.precision={precision}",
        "tasks.tasks_per_batch=8",
        "tasks.support_size=16",
        "tasks.query_size=8",
        "tasks.query_count=5",
        "tasks.min_task_rows=6",
        "model.embedding_dim=8",
        "model.bottom_mlp=[8]",
        "model.top_mlp=[16, 1]",
        "meta.inner_lr=0.1",
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    return json.loads((out / "metrics.json").read_text())


def test_bf16_meta_training_lands_within_5_percent_of_fp32_mae(tmp_path):
    train = _ratings(tmp_path / "train", range(0, 48), 0)
    test = _ratings(tmp_path / "test", range(48, 64), 1)
    fp32 = _train(train, test, tmp_path / "fp32", "fp32")
    bf16 = _train(train, test, tmp_path / "bf16", "bf16")
    assert bf16["steps"] == fp32["steps"] == 30 and bf16["tasks"] == fp32["tasks"] == 16
    assert bf16["mae"] != fp32["mae"]  # the run did compute in bfloat16
    assert bf16["mae"] == pytest.approx(fp32["mae"], rel=0.05)
    assert bf16["mae"] < bf16["mae_no_adapt"]  # the adaptation still helps under bf16
