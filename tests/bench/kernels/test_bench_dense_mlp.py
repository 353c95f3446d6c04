"""``python -m recaccel.bench.kernels.dense_mlp`` at a tiny batch on the CPU: every candidate runs,
the fast path agrees with the plain layers, and the report and JSON are written."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from recaccel.bench.kernels import dense_mlp
from recaccel.errors import RecaccelError


def _args(tmp_path, **over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    dense_mlp.add_args(parser)
    args = parser.parse_args(["--device", "cpu", "--batch", "3", "--repeats", "1", "--warmup", "0"])
    args.out, args.json = str(tmp_path / "dense_mlp.md"), str(tmp_path / "dense_mlp.json")
    vars(args).update(over)
    return args


def test_dense_mlp_bench_times_plain_and_fast_per_precision_and_they_agree(tmp_path):
    args = _args(tmp_path, precision="fp32,bf16")
    out = dense_mlp.main(args, "python -m recaccel.bench.kernels.dense_mlp --batch 3")
    rows = json.loads((tmp_path / "dense_mlp.json").read_text())["rows"]
    assert [(r["precision"], r["candidate"]) for r in rows] == [
        ("fp32", "plain"),
        ("fp32", "fast"),
        ("bf16", "plain"),
        ("bf16", "fast"),
    ]
    by = {(r["precision"], r["candidate"]): r for r in rows}
    # Errors against float64: fp32 near its rounding, bf16 near its own (and far coarser).
    assert by["fp32", "fast"]["max_rel_err"] <= 1e-5 and by["fp32", "fast"]["max_rel_err_grad"] <= 1e-4
    assert 1e-4 < by["bf16", "plain"]["max_rel_err"] <= 2e-2
    assert by["bf16", "fast"]["max_rel_err"] <= 4 * by["bf16", "plain"]["max_rel_err"] + 1e-2
    assert all(r["ms"] > 0 for r in rows)
    assert "| mlps fwd+bwd | bf16 | fast |" in out.read_text()


def test_mlp_flops_count_forward_and_both_backward_gemms():
    macs = 13 * 512 + 512 * 256 + 256 * 128 + 479 * 1024 + 1024 * 1024 + 1024 * 512 + 512 * 256 + 256
    assert dense_mlp.mlp_flops(2) == 3 * 2 * 2 * macs


def test_adam_comparison_runs_only_where_a_fused_kernel_exists(tmp_path):
    assert dense_mlp.optimizer_rows(_args(tmp_path), torch.device("cpu")) == []


@pytest.mark.gpu
def test_dense_mlp_bench_on_cuda_reports_the_matmul_share_and_fused_adam(tmp_path):
    args = _args(tmp_path, device="cuda", batch=256, precision="tf32,bf16")
    dense_mlp.main(args, "gpu test")
    rows = json.loads((tmp_path / "dense_mlp.json").read_text())["rows"]
    assert {r["candidate"] for r in rows if r["what"] == "adam step"} == {"foreach", "fused"}
    assert all(r["of_bf16_matmul"] is not None for r in rows if r["what"] == "mlps fwd+bwd")


def test_the_check_stops_a_fast_path_beyond_the_precisions_own_error():
    reference = [torch.tensor([1.0, -2.0], dtype=torch.float64)]
    plain = [torch.tensor([1.01, -2.0])]  # 0.5% off: bf16's own error here
    close = [torch.tensor([1.0, -2.03])]
    plain_err, fast_err = dense_mlp.check_fast_path(reference, plain, close, "bf16")
    assert plain_err[0] == pytest.approx(0.005) and fast_err[0] == pytest.approx(0.015)
    with pytest.raises(RecaccelError, match=r"fast path's outputs in bf16 .* over 0\.03"):
        dense_mlp.check_fast_path(reference, plain, [torch.tensor([1.0, -2.1])], "bf16")
    with pytest.raises(RecaccelError, match="outputs in fp32"):
        dense_mlp.check_fast_path(reference, plain, [torch.tensor([float("nan"), -2.0])], "fp32")
