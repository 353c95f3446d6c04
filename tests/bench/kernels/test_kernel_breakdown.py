"""Per-kernel device time of the DCN-v2 bench: kernel classes, per-iteration rows from
recorded spans, the profiler path, the markdown's note where CUDA is missing."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import torch

from recaccel.bench.gpu_check.plan import BENCH_ARGS
from recaccel.bench.gpu_check.runner import bench_argv
from recaccel.bench.kernels.dcnv2 import kernel_breakdown_note
from recaccel.bench.kernels.kernel_breakdown import (
    ELEMENTWISE,
    FUSED,
    GEMM,
    OTHER,
    REDUCTION,
    breakdown_path,
    breakdown_rows,
    class_totals,
    kernel_class,
    profile_fwd_bwd,
    write_breakdown,
)
from recaccel.cli import bench_main
from recaccel.ops.interaction import dcnv2_cross_reference, init_cross_weights
from recaccel.plotting.timeline import BACKWARD, FORWARD, Span, Timeline

STREAM = "CUDA stream 7"


@pytest.mark.parametrize(
    "name,cls",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas", GEMM),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", GEMM),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", GEMM),
        ("_cross_bwd_ew_kernel", ELEMENTWISE),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
            ELEMENTWISE,
        ),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, sum_functor>>", REDUCTION),
        ("_cross_fwd_kernel", FUSED),
        ("some_vendor_kernel", OTHER),
    ],
)
def test_kernel_class_tells_gemm_elementwise_reduction_and_the_fused_kernel_apart(name, cls):
    assert kernel_class(name) == cls


def _recorded_two_iterations() -> Timeline:
    """Two iterations 10 ms apart: per iteration two 1 ms GEMMs (forward), a 0.5 ms elementwise
    pass and a 0.25 ms column reduction (backward); a CPU span the table must ignore."""
    spans = [Span("CPU thread 1 (main)", FORWARD, "dense forward", 0.0, 9.0)]
    for start in (0.0, 10.0):
        spans += [
            Span(STREAM, FORWARD, "nvjet_tst_gemm", start, start + 1.0),
            Span(STREAM, FORWARD, "nvjet_tst_gemm", start + 1.0, start + 2.0),
            Span(STREAM, BACKWARD, "_cross_bwd_ew_kernel", start + 2.0, start + 2.5),
            Span(STREAM, BACKWARD, "void at::native::reduce_kernel<sum>", start + 2.5, start + 2.75),
        ]
    return Timeline(spans, [0.0, 10.0])


def test_breakdown_rows_give_launches_and_ms_per_iteration_with_class_and_pass():
    rows = breakdown_rows(_recorded_two_iterations())
    assert [(r["kernel"], r["class"], r["pass"], r["launches_per_step"]) for r in rows] == [
        ("nvjet_tst_gemm", GEMM, "forward", 2),
        ("_cross_bwd_ew_kernel", ELEMENTWISE, "backward", 1),
        ("reduce_kernel<sum>", REDUCTION, "backward", 1),  # namespaces dropped
    ]
    assert [r["ms_per_step"] for r in rows] == pytest.approx([2.0, 0.5, 0.25])
    assert [r["share"] for r in rows] == pytest.approx([2 / 2.75, 0.5 / 2.75, 0.25 / 2.75], abs=1e-4)
    totals = class_totals(rows)
    assert list(totals) == [GEMM, ELEMENTWISE, REDUCTION]
    assert totals[GEMM]["ms_per_step"] == pytest.approx(2.0)
    assert totals[GEMM]["share"] == pytest.approx(2 / 2.75, abs=1e-4)


def test_breakdown_markdown_has_a_summary_by_class_and_a_table_per_candidate(tmp_path):
    rows = breakdown_rows(_recorded_two_iterations())
    path = write_breakdown({"gemm B=4 K=12": rows, "eager B=4 K=12": []}, tmp_path / "d_kernels.md", "t", 2)
    text = path.read_text()
    assert "| gemm B=4 K=12 | 2.750 | 4 | GEMM 2.000 (72.7%); elementwise 0.500 (18.2%); reduction" in text
    assert "| eager B=4 K=12 | 0.000 | 0 | - |" in text
    assert "| `_cross_bwd_ew_kernel` | elementwise | backward | 1 | 0.5000 | 18.2% |" in text
    assert "## gemm B=4 K=12" in text and "## eager B=4 K=12" in text


def test_profiled_iterations_are_counted_and_cpu_runs_show_no_kernels():
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 12, generator=gen)
    u, v, b = init_cross_weights(12, 2, 3, gen)
    timeline = profile_fwd_bwd(dcnv2_cross_reference, [x0, u, v, b], torch.randn(4, 12, generator=gen),
                               torch.device("cpu"), iterations=3)  # fmt: skip
    assert len(timeline.step_starts) == 3
    assert sum(s.kind == FORWARD and s.row.startswith("CPU") for s in timeline.spans) == 3
    assert breakdown_rows(timeline) == []


def test_cpu_bench_writes_its_markdown_with_the_kernel_table_skip_note(tmp_path):
    out = tmp_path / "dcnv2.md"
    argv = ["interaction", "--kind", "dcnv2", "--batch", "4", "--fields", "1", "--dim", "3", "--layers", "1"]
    argv += ["--rank", "2", "--repeats", "1", "--device", "cpu", "--out", str(out)]
    assert bench_main(argv) == 0
    assert (
        "Per-kernel device time: skipped on cpu (the profiler's kernel times need CUDA)." in out.read_text()
    )
    assert not breakdown_path(out).exists()


def test_gpu_check_dcnv2_part_writes_the_kernel_table_into_its_tarred_parts_folder(tmp_path):
    """gpu-check tars every file of its parts folder; the bench's table lands there."""
    argv = bench_argv("dcnv2", "cuda", tmp_path, {"--json", "--plot"}, plots=False)
    md = Path(argv[argv.index("--out") + 1])
    assert breakdown_path(md) == tmp_path / "dcnv2_kernels.md"
    assert "--kind" in BENCH_ARGS["cuda"]["dcnv2"]


@pytest.mark.gpu
def test_gpu_kernel_table_shows_the_gemm_path_as_gemm_and_elementwise(tmp_path):
    args = Namespace(device="cuda", dtype="bfloat16", batch=[1024], fields=[7], dim=[16], layers=2, rank=32)
    note = kernel_breakdown_note(args, tmp_path / "dcnv2.md")
    assert note.endswith("dcnv2_kernels.md"), note
    text = (tmp_path / "dcnv2_kernels.md").read_text()
    gemm_part = text.split("## gemm B=1024 K=128")[1].split("## ")[0]
    assert "| GEMM |" in gemm_part and "`_cross_fwd_ew_kernel` | elementwise |" in gemm_part
    assert "`_cross_bwd_ew_kernel` | elementwise |" in gemm_part
    assert "| eager B=1024 K=128 |" in text and "| fused B=1024 K=128 |" in text
