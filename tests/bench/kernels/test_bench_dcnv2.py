"""recaccel-bench interaction --kind dcnv2: eager, the GEMM path and the fused kernel timed together."""

from __future__ import annotations

import json

import pytest
import torch

from recaccel.bench.kernels.dcnv2 import TARGET_FWD_BWD, run_dcnv2_bench, target_verdict, write_markdown
from recaccel.ops.backend import triton_interpret_enabled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton needs CUDA or the interpreter",
)
def test_rows_time_every_implementation_and_check_each_against_float64(tmp_path):
    rows = run_dcnv2_bench(
        [5], [2], [4], repeats=2, device=DEVICE, json_path=tmp_path / "d.json", warmup=1, layers=2, rank=3,
        dtype=torch.float32,
    )  # fmt: skip
    (row,) = rows
    assert (row["batch"], row["K"], row["layers"], row["rank"]) == (5, 12, 2, 3)
    for name in ("eager", "gemm", "fused"):
        assert row[f"{name}_rel_err"] < 1e-5
        assert row[f"{name}_fwd_ms"] > 0 and row[f"{name}_fwd_bwd_ms"] > 0
    assert row["gemm_fwd_bwd_speedup"] == pytest.approx(row["eager_fwd_bwd_ms"] / row["gemm_fwd_bwd_ms"])
    assert json.loads((tmp_path / "d.json").read_text())["results"] == rows
    text = write_markdown(rows, tmp_path / "d.md", "recaccel-bench interaction --kind dcnv2").read_text()
    assert (
        "GEMM path and fused kernel vs PyTorch eager" in text and f"target B=5 K=12: {row['target']}" in text
    )


def test_target_is_judged_on_cuda_only_and_says_by_how_much_it_is_missed():
    cuda = {"device": "cuda:0"}
    assert target_verdict({**cuda, "gemm_fwd_bwd_speedup": 1.62}).startswith("met: gemm fwd+bwd 1.62x")
    missed = target_verdict({**cuda, "gemm_fwd_bwd_speedup": 1.2})
    assert missed.startswith(f"not met (short by {TARGET_FWD_BWD - 1.2:.2f}x)")
    assert target_verdict({"device": "cpu", "gemm_fwd_bwd_speedup": 9.0}).startswith("not judged")
    assert target_verdict({"device": "cuda:0"}).startswith("not measured")
