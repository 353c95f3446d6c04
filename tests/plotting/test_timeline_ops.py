"""The kernel tables name each kernel's launching op (shapes and dtypes) and keep the part
of a C++ kernel name that tells two kernels apart."""

from __future__ import annotations

import json

import pytest
import torch

from recaccel.bench.kernels.kernel_breakdown import breakdown_rows, write_breakdown
from recaccel.plotting.timeline import (
    FORWARD,
    kernel_table,
    op_label,
    short_kernel_name,
    spans_from_trace,
)

COPY = (
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const>"
)


def _x(name, tid, ts, dur, cat="user_annotation", **args):
    return {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur, "cat": cat, "args": args}


def _copy_op(external_id: int, dims: list, types: list) -> dict:
    return {
        "ph": "X", "name": "aten::copy_", "tid": 1, "ts": 1000.0 + external_id, "dur": 1.0, "cat": "cpu_op",
        "args": {"External id": external_id, "Input Dims": dims, "Input type": types},
    }  # fmt: skip


def _trace() -> dict:
    """One step: the same copy kernel launched by two copies (75 us from a bf16 cast of
    [4096, 500, 32], 25 us from a float copy), the first kernel carrying its op's External
    id, the second only its launch."""
    return {
        "traceEvents": [
            _x("recaccel-bench/step", 1, 1000.0, 900.0),
            _x("recaccel-bench/dense forward", 1, 1000.0, 500.0),
            _copy_op(41, [[4096, 500, 32], [4096, 500, 32], []], ["c10::BFloat16", "float", "Scalar"]),
            _copy_op(42, [[64, 8], [64, 8], []], ["float", "float", "Scalar"]),
            _x("cudaLaunchKernel", 1, 1041.0, 1.0, "cuda_runtime", correlation=7, **{"External id": 41}),
            _x("cudaLaunchKernel", 1, 1042.0, 1.0, "cuda_runtime", correlation=8, **{"External id": 42}),
            _x(COPY, 0, 1100.0, 75.0, "kernel", stream=7, correlation=7, **{"External id": 41}),
            _x(COPY, 0, 1200.0, 25.0, "kernel", stream=7, correlation=8),
            _x("gemm", 0, 1300.0, 10.0, "kernel", stream=7, correlation=99),  # its launch is not in the trace
        ]
    }


def test_op_label_names_the_tensor_inputs_shapes_and_dtypes():
    event = _copy_op(1, [[4096, 500, 32], [4096, 500, 32], []], ["c10::BFloat16", "float", "Scalar"])
    assert op_label(event) == "aten::copy_ [4096, 500, 32] bf16, [4096, 500, 32] f32"
    assert op_label({"name": "aten::add", "args": {}}) == "aten::add"  # shapes not recorded
    many = {"name": "aten::cat", "args": {"Input Dims": [[1], [2], [3], [4]], "Input type": ["long int"] * 4}}
    assert op_label(many) == "aten::cat [1] i64, [2] i64, [3] i64"


def test_short_kernel_names_keep_the_functor_that_tells_kernels_apart():
    short = short_kernel_name(COPY)
    assert short.startswith("elementwise_kernel<128, 2, gpu_kernel_impl_nocast<direct_copy_kernel_cuda(")
    assert "at::native::" not in short and not short.startswith("void ")
    assert short_kernel_name("_bag_tile_kernel") == "_bag_tile_kernel"
    nested = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<c10::BFloat16>"
    assert short_kernel_name(nested) == "multi_tensor_apply_kernel<BFloat16>"
    # A namespace is removed only where it begins a qualified name.
    assert (
        short_kernel_name("void flat::gather<cuda::std::tuple<int>>") == "flat::gather<cuda::std::tuple<int>>"
    )


def test_kernel_table_names_the_op_that_launched_most_of_a_kernels_time():
    timeline = spans_from_trace(_trace())
    ops = {s.op for s in timeline.spans if s.row.startswith("CUDA")}
    assert ops == {
        "aten::copy_ [4096, 500, 32] bf16, [4096, 500, 32] f32",
        "aten::copy_ [64, 8] f32, [64, 8] f32",
        "",
    }
    rows = kernel_table(timeline)
    copy = rows[0]
    assert copy["kernel"].startswith("elementwise_kernel<128, 2, gpu_kernel_impl_nocast<direct_copy")
    assert copy["phase"] == FORWARD and copy["launches_per_step"] == 2 and copy["ms_per_step"] == 0.1
    assert copy["launched_by"] == "aten::copy_ [4096, 500, 32] bf16, [4096, 500, 32] f32 (75%)"
    assert rows[1]["kernel"] == "gemm" and rows[1]["launched_by"] == ""


def test_breakdown_markdown_shows_the_launching_op(tmp_path):
    rows = breakdown_rows(spans_from_trace(_trace()))
    path = write_breakdown({"eager": rows}, tmp_path / "k.md", "test", iterations=1)
    text = path.read_text()
    assert "| launched by |" in text
    assert "`aten::copy_ [4096, 500, 32] bf16, [4096, 500, 32] f32 (75%)`" in text
    assert "| `gemm` | GEMM | other | 1 | 0.0100 | 9.1% | - |" in text


def test_a_real_profile_names_its_ops_shapes_as_the_tables_read_them(tmp_path):
    """torch's own trace (profiler with shapes on, as profile_steps runs it) carries the
    fields op_label reads, under the names it expects."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        (x.to(torch.bfloat16) @ x.t().to(torch.bfloat16)).sum()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    labels = {op_label(e) for e in events if e.get("cat") == "cpu_op"}
    assert "aten::mm [64, 8] bf16, [8, 64] bf16" in labels
    assert "aten::_to_copy [64, 8] f32" in labels


@pytest.mark.gpu
def test_cuda_kernels_are_named_with_the_op_that_launched_them():
    """On a real CUDA trace (Kineto's fields, not a synthetic one): a GEMM and an elementwise
    cast each carry their aten op with its shapes."""
    from recaccel.bench.harness.profiling import profile_steps

    a = torch.randn(256, 128, device="cuda")
    b = torch.randn(128, 64, device="cuda")

    def step():
        (a @ b).to(torch.bfloat16)

    step()
    rows = kernel_table(profile_steps(step, 2, torch.device("cuda")), top=50)
    launched = {r["launched_by"] for r in rows}
    assert any(op.startswith("aten::mm [256, 128] f32, [128, 64] f32") for op in launched), rows
    assert any(op.startswith("aten::copy_ [256, 64] bf16, [256, 64] f32") for op in launched), rows
