"""DCN-v2 GEMM path fusions: the bias gradient summed inside the backward elementwise kernel
(column sums per row strip), and layer 0's forward reading x0 once."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.interaction import dcnv2_cross_reference

pytestmark = [
    pytest.mark.numeric,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_interpret_enabled()),
        reason="triton kernels need CUDA or TRITON_INTERPRET=1",
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _rel_err(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _cross_inputs(b, k, r, layers, dtype, seed):
    """x0 [B, K] and weights scaled so every layer's output stays O(1)."""
    x0 = _randn(b, k, seed=seed, dtype=torch.float64)
    u = _randn(layers, k, r, seed=seed + 1, dtype=torch.float64) / k**0.5
    v = _randn(layers, r, k, seed=seed + 2, dtype=torch.float64) / k**0.5
    bias = _randn(layers, k, seed=seed + 3, dtype=torch.float64) * 0.1
    return [t.to(dtype) for t in (x0, u, v, bias)]


def _forward_and_grads(fn, inputs, grad):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


def _gemm(*tensors):
    from recaccel.ops.interaction.dcnv2_gemm import dcnv2_cross_gemm

    return dcnv2_cross_gemm(*tensors)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "rows,cols",
    [(1, 7), (150, 300), (1100, 5), (64, 128)],
    ids=["b1-odd-k", "three-strips-three-column-blocks", "narrow-k-two-strips", "one-whole-tile"],
)
def test_backward_pass_sums_its_stored_dy_per_column(rows, cols, dtype):
    """db is the column sum of the dy the kernel stored (float32), over strips that end in a
    partial one and column blocks that do not divide K; dy and the sum match torch."""
    from recaccel.ops.interaction.dcnv2_gemm import cross_backward_pass

    g, x0, y = (_randn(rows, cols, seed=s, dtype=dtype) for s in (1, 2, 3))
    acc = _randn(rows, cols, seed=4)
    dy, out, db = cross_backward_pass(g, x0, y, acc, final=False)
    assert db.dtype == torch.float32 and db.shape == (cols,)
    torch.testing.assert_close(db, dy.float().sum(0), rtol=1e-5, atol=1e-5 * rows**0.5)
    f32 = [t.float() for t in (g, x0, y)]
    half = dtype != torch.float32  # the interpreter truncates to 16 bits, CUDA rounds
    tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-6} if half else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(dy.float(), (f32[0] * f32[1]).to(dtype).float(), **tol)
    torch.testing.assert_close(out, acc + f32[0] * f32[2], rtol=1e-6, atol=1e-6)


def test_final_backward_pass_writes_the_input_dtype_and_sums_dy():
    from recaccel.ops.interaction.dcnv2_gemm import cross_backward_pass

    g, x0, y = (_randn(70, 33, seed=s, dtype=torch.bfloat16) for s in (5, 6, 7))
    dy, out, db = cross_backward_pass(g, x0, y, None, final=True)
    assert out.dtype == torch.bfloat16 and dy.dtype == torch.bfloat16
    f32 = [t.float() for t in (g, x0, y)]
    tol = {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(out.float(), (f32[0] * f32[2] + f32[0]).to(torch.bfloat16).float(), **tol)
    torch.testing.assert_close(db, dy.float().sum(0), rtol=1e-5, atol=1e-5)


def test_backward_pass_over_no_rows_gives_a_zero_bias_gradient():
    from recaccel.ops.interaction.dcnv2_gemm import cross_backward_pass

    empty = torch.empty(0, 9, device=DEVICE)
    dy, out, db = cross_backward_pass(empty, empty, empty, None, final=True)
    assert dy.shape == out.shape == (0, 9)
    torch.testing.assert_close(db, torch.zeros(9, device=DEVICE), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layer0_forward_reading_x0_once_equals_reading_a_copy(dtype):
    """x0 * y + x0 with x passed as x0 itself (one load) and as a separate copy (two loads)."""
    from recaccel.ops.interaction.dcnv2_gemm import cross_elementwise

    x0, y = _randn(3, 1705, seed=8, dtype=dtype), _randn(3, 1705, seed=9, dtype=dtype)
    once = cross_elementwise(x0, y, x0)
    torch.testing.assert_close(once, cross_elementwise(x0, y, x0.clone()), rtol=0, atol=0)
    want = (x0.float() * y.float() + x0.float()).to(dtype)
    tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-6} if dtype != torch.float32 else {}
    torch.testing.assert_close(once, want, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "b,k,r,layers",
    [(1, 7, 3, 1), (1, 45, 6, 3), (200, 131, 9, 3), (70, 5, 2, 1)],
    ids=["b1-l1", "b1-odd-k-l3", "several-strips-odd-k-l3", "narrow-k-l1"],
)
def test_gemm_path_matches_reference_with_fused_bias_gradient(b, k, r, layers, dtype):
    """Forward and every gradient (db from the kernel's column sums) against float64: fp32
    tightly, 16-bit within a small factor of eager PyTorch's own error in that dtype."""
    seed = 7 * b + k + r + layers
    inputs = _cross_inputs(b, k, r, layers, dtype, seed)
    grad = _randn(b, k, seed=seed + 9)
    got = _forward_and_grads(_gemm, inputs, grad)
    exact = _forward_and_grads(dcnv2_cross_reference, [t.double() for t in inputs], grad)
    names = ["out", "grad_x0", "grad_u", "grad_v", "grad_b"]
    assert [t.dtype for t in got] == [dtype] * 5
    if dtype == torch.float32:
        for name, x, want in zip(names, got, exact, strict=True):
            assert _rel_err(x, want) < 1e-5, name
        return
    # The interpreter truncates float32 to 16 bits where CUDA rounds to nearest.
    factor = 4 if DEVICE == "cpu" else 2
    eager = _forward_and_grads(dcnv2_cross_reference, inputs, grad)
    for name, x, e, want in zip(names, got, eager, exact, strict=True):
        assert _rel_err(x, want) < factor * _rel_err(e, want) + 1e-3, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemm_path_forward_and_gradients_are_bitwise_equal_across_runs(dtype):
    inputs = _cross_inputs(150, 131, 9, 3, dtype, seed=31)
    grad = _randn(150, 131, seed=32)
    first = _forward_and_grads(_gemm, inputs, grad)
    second = _forward_and_grads(_gemm, inputs, grad)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
