"""The embedding benchmark on a tiny CPU sweep: structure, files, and its correctness gate."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from recaccel.bench.kernels import embedding as bench
from recaccel.bench.kernels.embedding_cases import (
    Candidate,
    CandidateMismatchError,
    EmbeddingCase,
    bytes_moved,
    initial_rows,
    make_inputs,
    packed_candidate,
    per_table_candidate,
)
from recaccel.bench.kernels.embedding_run import evaluate_targets, run_embedding_bench
from recaccel.ops.backend import fbgemm_installed
from tests.helpers.embedding_bench import cpu_factories

TINY = [EmbeddingCase(tables=t, batch=16, dim=8, bag_len=2, rows=40) for t in (1, 3)]


def test_tiny_sweep_rows_json_and_plot(tmp_path):
    json_path, plot_path = tmp_path / "e.json", tmp_path / "e.png"
    result = run_embedding_bench(
        TINY,
        "cpu",
        repeats=2,
        warmup=1,
        num_batches=2,
        json_path=json_path,
        plot_path=plot_path,
        factories=cpu_factories(),
    )
    rows = result["results"]
    assert [(r["T"], r["mode"]) for r in rows] == [
        (t, m) for t in (1, 3) for m in ("forward", "fwd+bwd+update")
    ]
    timed = ["per_table", "reference"] + (["fbgemm"] if fbgemm_installed() else [])
    for row in rows:
        for name in timed:
            assert row[f"{name}_ms"] > 0
        for name in timed[1:]:
            assert row[f"{name}_x"] == pytest.approx(row["per_table_ms"] / row[f"{name}_ms"])
        assert "triton_ms" not in row and "per_table_x" not in row
        assert "reference_GBps" not in row  # bandwidth only on CUDA
    assert "interpreter" in result["skipped"]["triton"]
    assert result["copy_GBps"] is None and result["targets"] == []
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(result))
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _wrong(kind: str):
    """A reference candidate made wrong in its forward (``kind="forward"``) or its update (``"update"``)."""

    def build(case, init, device):
        good = packed_candidate("reference", seed=0)(case, init, device)
        if kind == "forward":
            return Candidate("wrong", lambda sf: good.forward(sf) * 1.001, good.train_step)
        doubled = packed_candidate("reference", seed=0)(replace(case, lr=2 * case.lr), init, device)
        return Candidate("wrong", doubled.forward, doubled.train_step)

    return build


@pytest.mark.parametrize("kind", ["forward", "update"])
def test_wrong_candidate_is_caught_before_timing(kind, tmp_path):
    factories = {k: v for k, v in cpu_factories().items() if k in ("per_table", "reference")}
    json_path = tmp_path / "never.json"
    with pytest.raises(CandidateMismatchError, match="'wrong'"):
        run_embedding_bench(
            TINY[:1],
            "cpu",
            repeats=1,
            warmup=0,
            num_batches=1,
            json_path=json_path,
            factories=factories,
            extra_candidates={"wrong": _wrong(kind)},
        )
    assert not json_path.exists()


def test_per_table_baseline_matches_reference_after_a_step():
    # Per-table nn.EmbeddingBag + torch.optim.SGD is the same math as the fused SGD.
    case = replace(TINY[1], lengths="variable", ids="zipf")
    inputs = make_inputs(case, 2, torch.device("cpu"), seed=3)
    init = initial_rows(case, 0)
    base = per_table_candidate(case, init, torch.device("cpu"))
    ref = packed_candidate("reference", seed=0)(case, init, torch.device("cpu"))
    for cand in (base, ref):
        cand.train_step(inputs.batches[0], inputs.grads[0])
    torch.testing.assert_close(base.forward(inputs.batches[1]), ref.forward(inputs.batches[1]))


def test_inputs_follow_the_case():
    case = EmbeddingCase(tables=2, batch=32, dim=4, bag_len=3, rows=25, lengths="variable", ids="zipf")
    a = make_inputs(case, 2, torch.device("cpu"), seed=1)
    b = make_inputs(case, 2, torch.device("cpu"), seed=1)
    for sf, sf2, g in zip(a.batches, b.batches, a.grads):
        assert torch.equal(sf.values, sf2.values) and torch.equal(sf.offsets, sf2.offsets)
        lengths = sf.lengths()
        assert sf.keys == ["t0", "t1"] and lengths.numel() == 2 * 32
        assert int(lengths.min()) >= 0 and int(lengths.max()) <= 6
        assert int(sf.values.min()) >= 0 and int(sf.values.max()) < 25
        assert g.shape == (32, 2, 4)
    fixed = make_inputs(replace(case, lengths="fixed"), 1, torch.device("cpu"))
    assert bool((fixed.batches[0].lengths() == 3).all())


def test_bytes_grow_with_optimizer_state():
    case = TINY[1]
    n, u = 96, 50
    fwd_sgd, train_sgd = bytes_moved(case, n, u)
    fwd_ada, train_ada = bytes_moved(replace(case, optimizer="rowwise_adagrad"), n, u)
    _, train_adam = bytes_moved(replace(case, optimizer="adam"), n, u)
    assert fwd_sgd == fwd_ada and train_sgd < train_ada < train_adam
    assert train_ada - train_sgd == 2 * u * 1 * 4  # one float per row, read and written
    assert train_adam - train_sgd == 2 * u * 2 * case.dim * 4


def test_default_cases_by_device():
    cpu = bench.default_cases("cpu")
    assert [(c.tables, c.batch, c.dim, c.bag_len) for c in cpu] == [
        (t, b, d, 1) for b, d in ((512, 16), (2048, 32)) for t in (1, 10, 100, 1000)
    ]
    assert all(c.rows * c.tables * c.dim * 4 <= 2**30 and c.rows <= 10_000 for c in cpu)
    gpu = bench.default_cases("cuda", tables=[100])
    assert {(c.tables, c.batch, c.dim, c.bag_len) for c in gpu} == {
        (100, 512, 16, 1),
        (100, 2048, 32, 1),
        (100, 16384, 128, 20),
    }
    assert all(c.rows == 100_000 for c in gpu)


def test_targets_report_met_and_missed():
    rows = [
        {"mode": "fwd+bwd+update", "T": 1000, "B": 512, "D": 16, "L": 1, "reference_x": 1.5, "fbgemm_x": 3.0},
        {"mode": "forward", "T": 1000, "B": 512, "D": 16, "L": 1, "reference_x": 5.0},
    ]
    verdicts = {t["candidate"]: t["met"] for t in evaluate_targets(rows, torch.device("cpu"))}
    assert verdicts == {"reference": False, "fbgemm": True}
    assert evaluate_targets(rows, torch.device("meta")) == []


def test_cli_main_writes_markdown(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    out = tmp_path / "embedding.md"
    args = parser.parse_args(
        [
            "--tables",
            "2",
            "--shapes",
            "8:4:1",
            "--cases",
            "--rows",
            "10",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--batches",
            "1",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "e.png"),
            "--note",
            "shared machine",
        ]
    )
    path = bench.main(args, "recaccel-bench embedding --tiny")
    text = path.read_text()
    assert path == out and "recaccel-bench embedding --tiny" in text
    assert "| fwd+bwd+update | 2 | 8 | 4 | 1 | 10 |" in text and "shared machine" in text
