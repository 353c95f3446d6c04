"""recaccel-bench interaction --kind dcnv2: the cross network timed fused against eager."""

from __future__ import annotations

import json

import pytest
import torch

from recaccel.bench.kernels.interaction import (
    ROOFLINE_CASES,
    run_interaction_bench,
    run_roofline_cases,
    write_markdown_summary,
)
from recaccel.cli import bench_main
from recaccel.ops.backend import triton_interpret_enabled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton needs CUDA or the interpreter",
)
def test_dcnv2_rows_time_all_candidates_and_check_the_kernel(tmp_path):
    results = run_interaction_bench(
        [3],
        2,
        [4],
        repeats=2,
        device=DEVICE,
        json_path=tmp_path / "r.json",
        warmup=1,
        kind="dcnv2",
        layers=2,
        rank=5,
    )
    (row,) = results
    assert (row["kind"], row["batch"], row["fields"], row["dim"], row["layers"], row["rank"]) == (
        "dcnv2", 3, 2, 4, 2, 5,
    )  # fmt: skip
    assert row["max_rel_err"] < 1e-5
    for name in ("eager_fwd", "triton_fwd", "eager_fwd_bwd", "triton_fwd_bwd"):
        assert row[f"{name}_ms"] > 0
    assert row["fwd_bwd_speedup"] == pytest.approx(row["eager_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"])
    assert row["eager_fwd_TFLOPs"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["results"] == results
    md = write_markdown_summary(
        results, tmp_path / "r.md", "recaccel-bench interaction --kind dcnv2"
    ).read_text()
    assert "DCN-v2 cross network" in md and "--kind dcnv2" in md


def test_dcnv2_through_the_cli_and_bad_kind(tmp_path, capsys):
    out = tmp_path / "interaction.md"
    argv = ["interaction", "--kind", "dcnv2", "--batch", "8", "--fields", "2", "--dim", "4", "--layers", "1"]
    argv += [
        "--rank",
        "3",
        "--repeats",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "i.png"),
    ]
    assert bench_main(argv) == 0
    assert "eager_fwd_bwd_ms" in out.read_text() and (tmp_path / "i.png").is_file()
    with pytest.raises(ValueError, match="kind must be one of"):
        run_interaction_bench([2], 1, [4], repeats=1, device="cpu", kind="cin")
    with pytest.raises(SystemExit):
        bench_main(["interaction", "--kind", "cin"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton needs CUDA or the interpreter",
)
def test_roofline_cases_time_the_padded_pair_kernels_in_bf16_and_tf32(tmp_path):
    assert ROOFLINE_CASES == ((65536, 26, 128), (4096, 500, 32))  # the shapes
    cases = ((3, 4, 5), (1, 69, 3))  # one row tile, and two (R = 70) with a batch of one
    results = run_roofline_cases(1, DEVICE, tmp_path / "r.json", cases=cases, warmup=0)
    assert [(r["precision"], r["batch"], r["fields"]) for r in results] == [
        ("bfloat16", 3, 4), ("bfloat16", 1, 69), ("tf32", 3, 4), ("tf32", 1, 69),
    ]  # fmt: skip
    for row in results:
        assert row["pad"] is True and row["max_rel_err"] < (1e-2 if row["dtype"] == "bfloat16" else 1e-5)
        assert row["fwd_beats_eager"] == (row["fwd_speedup"] > 1.0)
        on_cuda = DEVICE == "cuda"
        assert (row["roofline_target_met"] is None) != on_cuda  # needs the measured copy bandwidth
    assert json.loads((tmp_path / "r.json").read_text())["results"] == results


def test_dot_through_the_cli_in_tf32_padded_and_tf32_refused_for_dcnv2(tmp_path, capsys):
    out = tmp_path / "dot.md"
    argv = ["interaction", "--batch", "4", "--fields", "3", "--dim", "5", "--dtype", "tf32", "--pad"]
    assert bench_main([*argv, "--repeats", "2", "--device", "cpu", "--out", str(out)]) == 0
    assert "tf32" in out.read_text()
    assert bench_main(["interaction", "--kind", "dcnv2", "--dtype", "tf32", "--device", "cpu"]) == 2
    assert "--dtype tf32 is for --kind dot only" in capsys.readouterr().err
