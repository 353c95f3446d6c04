"""Dot interaction: the reference against its definition, the Triton path against the reference."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recaccel.bench.harness.timing import time_interleaved_samples
from recaccel.bench.kernels.interaction import run_interaction_bench, write_markdown_summary
from recaccel.models.arches import InteractionArch
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.interaction import (
    PAD_MULTIPLE,
    DotInteraction,
    dot_interaction,
    dot_interaction_backward_reference,
    dot_interaction_pair,
    dot_interaction_reference,
    interaction_output_dim,
)
from recaccel.ops.tf32 import tf32_enabled

pytestmark = pytest.mark.numeric


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
# ||out - ref|| / ||ref|| bounds: float32 accumulation, half-precision operands/outputs.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rand(shape, dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _assert_rel_close(out, ref, dtype):
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert err < REL_TOL[dtype], f"relative error {err:.3g} over {REL_TOL[dtype]} for {dtype}"


def test_reference_matches_definition():
    x = _rand((3, 6, 5), torch.float64, seed=1, device="cpu")
    out = dot_interaction_reference(x)
    b, r, d = x.shape
    assert out.shape == (b, interaction_output_dim(r - 1, d))
    torch.testing.assert_close(out[:, :d], x[:, 0])
    col = d
    for i in range(r):  # row-major strict upper triangle, as documented
        for j in range(i + 1, r):
            torch.testing.assert_close(out[:, col], (x[:, i] * x[:, j]).sum(-1))
            col += 1
    assert col == out.shape[1]


def test_reference_gradcheck_float64():
    x = _rand((2, 4, 3), torch.float64, seed=2, device="cpu").requires_grad_()
    assert torch.autograd.gradcheck(dot_interaction_reference, (x,))
    assert torch.autograd.gradgradcheck(dot_interaction_reference, (x,))


def test_written_out_backward_matches_autograd():
    x = _rand((3, 5, 4), torch.float64, seed=3, device="cpu").requires_grad_()
    out = dot_interaction_reference(x)
    g = _rand(out.shape, torch.float64, seed=4, device="cpu")
    (expected,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(dot_interaction_backward_reference(g, x), expected)


def _check_triton(b, f, d, dtype, seed):
    x = _rand((b, f + 1, d), dtype, seed=seed).requires_grad_()
    x_ref = x.detach().float().requires_grad_()
    out = dot_interaction(x, backend="triton")
    ref = dot_interaction_reference(x_ref)
    assert out.dtype == dtype and out.shape == ref.shape
    g = _rand(out.shape, dtype, seed=seed + 1)
    (gx,) = torch.autograd.grad(out, x, g)
    (gx_ref,) = torch.autograd.grad(ref, x_ref, g.float())
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(gx, gx_ref)
    else:
        _assert_rel_close(out, ref, dtype)
        _assert_rel_close(gx, gx_ref, dtype)


@needs_triton
@pytest.mark.parametrize(
    "b,f,d",
    [(1, 1, 4), (1, 26, 16), (3, 26, 13), (2, 1, 33), (2, 100, 7), (2, 5, 130)],
    ids=["b1-f1", "b1-f26", "f26-d13", "f1-d33", "f100", "d130"],
)
def test_triton_matches_reference_fp32(b, f, d):
    _check_triton(b, f, d, torch.float32, seed=10 * b + f + d)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype):
    _check_triton(3, 8, 24, dtype, seed=5)


@needs_triton
@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(1, 4),
    f=st.integers(1, 40),
    d=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_reference_random_shapes(b, f, d, seed):
    _check_triton(b, f, d, torch.float32, seed)


def _pair_inputs(b, r, d, dtype, seed):
    """dense [B, D] and pooled [B, R-1, D] as views of one [B, R+1, D] buffer (strided, like
    slices of a bigger activation), scaled so dot products are O(1)."""
    base = _rand((b, r + 1, d), torch.float32, seed=seed) / d**0.25
    base = base.to(dtype)
    return base[:, 0].requires_grad_(), base[:, 2:].detach().requires_grad_()


# Against a float64 reference: float32 sums carry rounding of order D * 2^-24 of O(1)
# terms (torch's float32 defaults); bf16 outputs are such sums rounded once more to 2^-9
# relative (torch's bf16 rtol), with an absolute term for sums that cancel to near zero.
_PAIR_TOL = {
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
}


@needs_triton
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("d", [7, 33])
@pytest.mark.parametrize("rows", [2, 27, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pair_kernels_match_reference_forward_and_backward(dtype, rows, d, pad):
    b = 1 if d == 7 else 3  # a batch of one, and one that leaves a partial block of rows
    seed = rows * 100 + d
    dense, pooled = _pair_inputs(b, rows, d, dtype, seed)
    x_ref = torch.cat([dense.detach().unsqueeze(1), pooled.detach()], 1).double().requires_grad_()
    out = dot_interaction_pair(dense, pooled, "triton", pad=pad)
    ref = dot_interaction_reference(x_ref, pad=pad)
    assert out.dtype == dtype and out.shape == ref.shape == (b, interaction_output_dim(rows - 1, d, pad=pad))
    torch.testing.assert_close(out.double(), ref, **_PAIR_TOL[dtype], check_dtype=False)
    g = _rand(out.shape, torch.float32, seed=seed + 1).to(dtype)
    g_dense, g_pooled = torch.autograd.grad(out, (dense, pooled), g)
    (gx_ref,) = torch.autograd.grad(ref, x_ref, g.double())
    torch.testing.assert_close(g_dense.double(), gx_ref[:, 0], **_PAIR_TOL[dtype], check_dtype=False)
    torch.testing.assert_close(g_pooled.double(), gx_ref[:, 1:], **_PAIR_TOL[dtype], check_dtype=False)


@needs_triton
def test_padded_output_is_zero_past_the_width_and_its_gradient_is_ignored():
    dense, pooled = _pair_inputs(2, 5, 3, torch.float32, seed=20)
    width = interaction_output_dim(4, 3)  # 3 + 10 = 13 -> 16
    out = dot_interaction_pair(dense, pooled, "triton", pad=True)
    assert out.shape[1] == 16 and out.shape[1] % PAD_MULTIPLE == 0
    assert torch.equal(out[:, width:], torch.zeros(2, 16 - width))
    torch.testing.assert_close(out[:, :width], dot_interaction_pair(dense, pooled, "triton"))
    g = _rand(out.shape, seed=21)
    g_pad_changed = g.clone()
    g_pad_changed[:, width:] = 1e6  # padding columns meet no input: their gradient goes nowhere
    grads = torch.autograd.grad(out, (dense, pooled), g, retain_graph=True)
    grads_changed = torch.autograd.grad(out, (dense, pooled), g_pad_changed)
    for a, b in zip(grads, grads_changed, strict=True):
        assert torch.equal(a, b)


@needs_triton
def test_many_tiles_pair_grid_matches_reference_and_backward_is_deterministic():
    dense, pooled = _pair_inputs(2, 200, 3, torch.float32, seed=22)  # 4 row tiles of 64: 10 pairs
    x = torch.cat([dense.detach().unsqueeze(1), pooled.detach()], 1)
    out = dot_interaction_pair(dense, pooled, "triton")
    torch.testing.assert_close(out, dot_interaction_reference(x))
    g = _rand(out.shape, seed=23)
    first = torch.autograd.grad(out, (dense, pooled), g, retain_graph=True)
    second = torch.autograd.grad(out, (dense, pooled), g)
    expected = dot_interaction_backward_reference(g, x)
    torch.testing.assert_close(first[0], expected[:, 0])
    torch.testing.assert_close(first[1], expected[:, 1:])
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # no atomics


def test_dot_precision_is_native_tf32_or_tf32x3_on_cuda_and_ieee_only_interpreted():
    from recaccel.ops.interaction.triton import dot_precision

    for allow in (False, True):
        for dtype in (torch.bfloat16, torch.float16):
            assert dot_precision(dtype, on_cuda=True, allow_tf32=allow) == "native"
        for dtype in (torch.float32, torch.bfloat16):
            assert dot_precision(dtype, on_cuda=False, allow_tf32=allow) == "ieee"
    assert dot_precision(torch.float32, on_cuda=True, allow_tf32=True) == "tf32"
    assert dot_precision(torch.float32, on_cuda=True, allow_tf32=False) == "tf32x3"


def test_reference_padding_and_pair_reference_agree_with_stacked():
    x = _rand((3, 4, 5), torch.float64, seed=24, device="cpu")  # width 5 + 6 = 11 -> 16
    padded = dot_interaction_reference(x, pad=True)
    assert padded.shape == (3, 16) == (3, DotInteraction.output_dim(3, 5, pad=True))
    torch.testing.assert_close(padded[:, :11], dot_interaction_reference(x), rtol=0, atol=0)
    assert not padded[:, 11:].any()
    paired = dot_interaction_pair(x[:, 0], x[:, 1:], "reference", pad=True)
    torch.testing.assert_close(paired, padded, rtol=0, atol=0)
    assert interaction_output_dim(26, 128) == 479 and interaction_output_dim(26, 128, pad=True) == 480


@pytest.mark.parametrize(
    "dense,pooled,match",
    [
        (torch.zeros(2, 4), torch.zeros(2, 3), r"dense \[B, D\] and pooled \[B, F, D\]"),
        (torch.zeros(2, 4), torch.zeros(3, 1, 4), "disagree in B or D"),
        (torch.zeros(2, 4), torch.zeros(2, 1, 4, dtype=torch.float64), "one dtype"),
    ],
)
def test_pair_bad_input_raises(dense, pooled, match):
    with pytest.raises(ValueError, match=match):
        dot_interaction_pair(dense, pooled, "reference")


@needs_triton
def test_interaction_arch_reads_dense_and_pooled_and_pads_on_request():
    dense, pooled = (t.detach() for t in _pair_inputs(3, 6, 4, torch.float32, seed=25))
    x = torch.cat([dense.unsqueeze(1), pooled], 1)
    arch = InteractionArch(5, 4, backend="triton", pad=True)
    out = arch(dense, pooled)
    assert arch.output_dim == 4 + 15 and out.shape == (3, 24)
    torch.testing.assert_close(out, dot_interaction_reference(x, pad=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = InteractionArch(5, 4, backend="triton")(dense, pooled)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half, dot_interaction_reference(x.bfloat16()), rtol=1.6e-2, atol=1e-3)


@needs_triton
def test_triton_non_contiguous_input_and_grad():
    base = _rand((5, 3, 4), seed=6)  # [D, B, R] storage, viewed as [B, R, D]
    x = base.permute(1, 2, 0)
    assert not x.is_contiguous()
    out = dot_interaction(x, backend="triton")
    torch.testing.assert_close(out, dot_interaction_reference(x))
    xg = x.detach().requires_grad_()
    g = _rand((out.shape[1], out.shape[0]), seed=7).t()  # non-contiguous grad_out
    (gx,) = torch.autograd.grad(dot_interaction(xg, backend="triton"), xg, g)
    torch.testing.assert_close(gx, dot_interaction_backward_reference(g, x))
    dot_interaction(xg, backend="triton").sum().backward()  # grad_out is expanded: all strides 0
    torch.testing.assert_close(xg.grad, dot_interaction_backward_reference(torch.ones_like(out), x))


@needs_triton
def test_triton_empty_batch():
    x = torch.empty(0, 4, 3, device=DEVICE)
    assert dot_interaction(x, backend="triton").shape == (0, 3 + 6)


@needs_triton
def test_triton_second_order_matches_reference():
    w = _rand((4 + 10,), seed=8)

    def grad_norm(x, backend):
        loss = (dot_interaction(x, backend) * w).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        return (gx**2).sum()

    x = _rand((2, 5, 4), seed=9).requires_grad_()
    (gg,) = torch.autograd.grad(grad_norm(x, "triton"), x)
    (gg_ref,) = torch.autograd.grad(grad_norm(x, "reference"), x)
    torch.testing.assert_close(gg, gg_ref)


@needs_triton
def test_triton_under_torch_func_vmap_and_grad():
    w = _rand((4 + 10,), seed=10)
    xs = _rand((3, 2, 5, 4), seed=11)  # 3 tasks of [B=2, R=5, D=4], as in meta-learning

    def loss(x, backend):
        return (dot_interaction(x, backend) * w).sum()

    per_task = torch.func.vmap(torch.func.grad(lambda x: loss(x, "triton")))(xs)
    per_task_ref = torch.func.vmap(torch.func.grad(lambda x: loss(x, "reference")))(xs)
    torch.testing.assert_close(per_task, per_task_ref)
    out = torch.func.vmap(lambda x: dot_interaction(x, "triton"))(xs)
    torch.testing.assert_close(out, torch.stack([dot_interaction_reference(x) for x in xs]))


def test_module_and_output_dim():
    x = _rand((2, 27, 8), seed=12, device="cpu")
    module = DotInteraction(backend="reference")
    out = module(x)
    assert out.shape == (2, DotInteraction.output_dim(26, 8)) == (2, 8 + 27 * 26 // 2)
    torch.testing.assert_close(out, dot_interaction_reference(x))
    assert "reference" in repr(module)


def test_auto_is_reference_on_cpu():
    x = _rand((2, 4, 3), seed=13, device="cpu")
    torch.testing.assert_close(dot_interaction(x), dot_interaction_reference(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "x,match",
    [
        (torch.zeros(2, 3), r"\[B, F\+1, D\]"),
        (torch.zeros(2, 3, 4, dtype=torch.int64), "floating-point"),
        (torch.zeros(2, 0, 4), "at least one row"),
    ],
)
def test_bad_input_raises(x, match):
    with pytest.raises(ValueError, match=match):
        dot_interaction(x, backend="reference")


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        dot_interaction(torch.zeros(1, 2, 3), backend="cuda")
    with pytest.raises(ValueError, match="not implemented"):
        dot_interaction(torch.zeros(1, 2, 3), backend="fbgemm")
    with pytest.raises(ValueError, match="unknown backend"):
        DotInteraction(backend="fast")


@needs_triton
def test_triton_rejects_float64():
    with pytest.raises(ValueError, match="float64"):
        dot_interaction(torch.zeros(1, 2, 3, dtype=torch.float64, device=DEVICE), backend="triton")


def test_time_interleaved_rotates_and_counts_calls():
    calls = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = time_interleaved_samples(candidates, repeats=4, warmup=2, device="cpu")
    assert {k: len(v) for k, v in samples.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(ms >= 0 for v in samples.values() for ms in v)
    timed = calls[6:]  # after 2 warmup rounds of 3
    assert [timed[3 * r] for r in range(4)] == ["a", "b", "c", "a"]  # first slot rotates
    assert all(sorted(timed[3 * r : 3 * r + 3]) == ["a", "b", "c"] for r in range(4))


@needs_triton
def test_bench_writes_json_plot_and_markdown(tmp_path):
    results = run_interaction_bench(
        [2],
        2,
        [4, 5],
        repeats=2,
        device=DEVICE,
        json_path=tmp_path / "r.json",
        plot_path=tmp_path / "r.png",
        warmup=1,
    )
    assert [(r["batch"], r["fields"], r["dim"]) for r in results] == [(2, 2, 4), (2, 2, 5)]
    for r in results:
        assert r["max_rel_err"] < 1e-5
        for name in ("eager_fwd", "triton_fwd", "eager_fwd_bwd", "triton_fwd_bwd"):
            assert r[f"{name}_ms"] > 0
        assert r["fwd_speedup"] == pytest.approx(r["eager_fwd_ms"] / r["triton_fwd_ms"])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["results"] == results and saved["env"]["torch"] == torch.__version__
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = write_markdown_summary(
        results, tmp_path / "r.md", "recaccel-bench interaction --batch 2"
    ).read_text()
    assert "recaccel-bench interaction --batch 2" in md and torch.__version__ in md
    assert md.count("\n| 2 | 2 |") == 2  # one table row per shape


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [27, 28])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_size(rows, dtype):
    b, d = 16384, 128
    x = (_rand((b, rows, d), torch.float32, seed=rows, device="cuda") / d**0.25).to(dtype).requires_grad_()
    x_ref = x.detach().double().requires_grad_()
    out = dot_interaction(x)  # auto -> triton on CUDA
    ref = dot_interaction_reference(x_ref)
    g = _rand(out.shape, torch.float32, seed=1, device="cuda").to(dtype)
    (gx,) = torch.autograd.grad(out, x, g)
    (gx_ref,) = torch.autograd.grad(ref, x_ref, g.double())
    if dtype == torch.float32 and not tf32_enabled():
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx.double(), gx_ref, rtol=1e-5, atol=1e-4)
    else:
        _assert_rel_close(out, ref, dtype)
        _assert_rel_close(gx, gx_ref, dtype)


@pytest.mark.gpu
def test_gpu_auto_falls_back_to_reference_for_float64():
    x = _rand((4, 6, 5), torch.float64, seed=14, device="cuda").requires_grad_()
    assert torch.autograd.gradcheck(dot_interaction, (x,))  # auto: float64 has no triton path
    with pytest.raises(ValueError, match="float64"):
        dot_interaction(x, backend="triton")
