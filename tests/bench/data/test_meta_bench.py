"""The meta benchmark runs end to end on tiny shapes and its engines agree (never speed)."""

from __future__ import annotations

import argparse

import pytest

from recaccel.bench.data.meta import MetaBenchSpec, add_args, main, run_meta_bench


def test_run_meta_bench_rows(tmp_path):
    spec = MetaBenchSpec(
        num_fields=2, num_dense=3, embedding_dim=4, cardinality=10, bottom_mlp=[8, 4], top_mlp=[8, 1]
    )
    rows = run_meta_bench(2, 3, 4, repeats=2, warmup=1, json_path=tmp_path / "m.json", spec=spec)
    assert {(r["engine"], r["order"]) for r in rows} == {
        (e, o) for e in ("batched", "vmap", "loop") for o in ("first", "second")
    }
    for r in rows:
        assert r["loss_diff_vs_loop"] == pytest.approx(0.0, abs=1e-5)
        assert r["ms"] > 0 and r["tasks_per_s"] == pytest.approx(2 / (r["ms"] * 1e-3))
        assert 0 < r["graph_MiB"] <= r["peak_MiB"]
    assert (tmp_path / "m.json").is_file()


def test_main_writes_markdown(tmp_path):
    parser = argparse.ArgumentParser()
    add_args(parser)
    out = tmp_path / "meta.md"
    args = parser.parse_args(
        [
            "--tasks",
            "2",
            "--support",
            "2",
            "--query",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--fields",
            "2",
            "--dim",
            "4",
            "--cardinality",
            "8",
            "--engines",
            "batched,loop",
            "--orders",
            "first",
            "--no-memory",
            "--embedding",
            "per_table",
            "--out",
            str(out),
        ]
    )
    assert main(args, "recaccel-bench meta ...") == out
    text = out.read_text()
    assert "recaccel-bench meta ..." in text and "| batched | first |" in text
