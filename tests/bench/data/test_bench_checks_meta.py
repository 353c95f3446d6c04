"""The meta benchmark refuses to time an engine whose outer loss or outer gradients differ
from the per-task loop's of the same order."""

from __future__ import annotations

import pytest

from recaccel.bench.data import meta
from recaccel.errors import RecaccelError

SPEC = meta.MetaBenchSpec(
    num_fields=2, num_dense=3, embedding_dim=4, cardinality=10, bottom_mlp=[8, 4], top_mlp=[8, 1]
)
RIGHT_LEARNER = meta._learner


def test_an_engine_that_ignores_second_order_is_refused_before_timing(monkeypatch, tmp_path):
    # Same loss as second order, different gradients: the outer loss alone cannot tell them apart.
    def learner(model, spec, engine, order):
        return RIGHT_LEARNER(model, spec, engine, "first" if engine == "batched" else order)

    monkeypatch.setattr(meta, "_learner", learner)
    with pytest.raises(RecaccelError, match="'batched'.*second"):
        meta.run_meta_bench(
            2, 3, 4, repeats=1, warmup=0, json_path=tmp_path / "never.json", engines=("batched", "loop"),
            orders=("second",), memory=False, spec=SPEC,
        )  # fmt: skip
    assert not (tmp_path / "never.json").exists()


def test_an_engine_with_a_different_inner_step_is_refused_before_timing(monkeypatch):
    def learner(model, spec, engine, order):
        wrong = meta.MetaBenchSpec(**{**meta.asdict(spec), "inner_lr": 2 * spec.inner_lr})
        return RIGHT_LEARNER(model, wrong if engine == "vmap" else spec, engine, order)

    monkeypatch.setattr(meta, "_learner", learner)
    with pytest.raises(RecaccelError, match="'vmap'.*first"):
        meta.run_meta_bench(
            2, 3, 4, repeats=1, warmup=0, engines=("vmap", "loop"), orders=("first",), memory=False,
            spec=SPEC,
        )  # fmt: skip


def test_engines_that_agree_are_timed_with_their_differences_reported():
    rows = meta.run_meta_bench(2, 3, 4, repeats=1, warmup=0, memory=False, spec=SPEC)
    for row in rows:
        assert row["ms"] > 0 and row["loss_diff_vs_loop"] <= 1e-5 and row["grad_diff_vs_loop"] <= 1e-4
