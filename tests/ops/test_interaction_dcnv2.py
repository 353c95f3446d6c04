"""DCN-v2 cross network: the reference against its definition, the Triton path against the reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.interaction import (
    dcnv2_cross,
    dcnv2_cross_backward_reference,
    dcnv2_cross_reference,
    init_cross_weights,
)
from recaccel.ops.tf32 import tf32

pytestmark = pytest.mark.numeric


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = ("gemm", "fused")
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)


def _inputs(b, k, r, layers, dtype=torch.float32, seed=0, device=DEVICE):
    """x0 [B, K] and weights scaled so every layer's output stays O(1)."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, k, generator=g, dtype=torch.float64)
    u = torch.randn(layers, k, r, generator=g, dtype=torch.float64) / k**0.5
    v = torch.randn(layers, r, k, generator=g, dtype=torch.float64) / k**0.5
    bias = torch.randn(layers, k, generator=g, dtype=torch.float64) * 0.1
    return [t.to(device=device, dtype=dtype) for t in (x0, u, v, bias)]


def _rel_err(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _forward_and_grads(fn, inputs, grad):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


def test_reference_matches_definition():
    x0, u, v, b = _inputs(3, 5, 2, 2, torch.float64, seed=1, device="cpu")
    x = x0
    for layer in range(2):  # x_{l+1} = x0 * (U (V x_l) + b) + x_l, one row at a time
        x = torch.stack([x0[i] * (u[layer] @ (v[layer] @ x[i]) + b[layer]) + x[i] for i in range(3)])
    torch.testing.assert_close(dcnv2_cross_reference(x0, u, v, b), x)


def test_reference_gradcheck_and_written_out_backward():
    inputs = [t.requires_grad_() for t in _inputs(2, 4, 3, 2, torch.float64, seed=2, device="cpu")]
    assert torch.autograd.gradcheck(dcnv2_cross_reference, inputs)
    out = dcnv2_cross_reference(*inputs)
    g = torch.randn(out.shape, dtype=torch.float64)
    expected = torch.autograd.grad(out, inputs, g)
    written = dcnv2_cross_backward_reference(g, *[t.detach() for t in inputs])
    for got, want in zip(written, expected, strict=True):
        torch.testing.assert_close(got, want)


def _check_triton(b, k, r, layers, dtype, seed, kernel="fused"):
    inputs = _inputs(b, k, r, layers, dtype, seed)
    grad = torch.randn(b, k, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    got = _forward_and_grads(lambda *t: dcnv2_cross(*t, backend="triton", kernel=kernel), inputs, grad)
    exact = _forward_and_grads(dcnv2_cross_reference, [t.double() for t in inputs], grad)
    assert got[0].dtype == dtype and got[0].shape == (b, k)
    names = ["out", "grad_x0", "grad_u", "grad_v", "grad_b"]
    if dtype == torch.float32:
        for name, x, want in zip(names, got, exact, strict=True):
            assert _rel_err(x, want) < 1e-5, name
        return
    # 16-bit: within a small factor of eager PyTorch in the same dtype (which rounds after
    # every op). Triton's interpreter truncates float32 to bfloat16 (CUDA rounds to nearest).
    factor = 4 if dtype == torch.bfloat16 and DEVICE == "cpu" else 2
    eager = _forward_and_grads(dcnv2_cross_reference, inputs, grad)
    for name, x, e, want in zip(names, got, eager, exact, strict=True):
        assert _rel_err(x, want) < factor * _rel_err(e, want) + 1e-3, name


@needs_triton
@pytest.mark.parametrize(
    "b,k,r,layers",
    [(1, 7, 1, 1), (1, 16, 4, 3), (5, 20, 3, 2), (70, 40, 20, 3), (3, 130, 70, 2)],
    ids=["b1-r1-l1", "b1", "small", "two-row-blocks", "k130-r70"],
)
def test_triton_matches_reference_fp32(b, k, r, layers):
    _check_triton(b, k, r, layers, torch.float32, seed=b + k + r + layers)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype):
    _check_triton(9, 33, 17, 3, dtype, seed=5)


def _assert_close_to_exact(got, exact, dtype, layers):
    """Elementwise closeness to the float64 result, with a tolerance from the dtype's epsilon:
    each layer rounds its GEMM outputs and its elementwise result (a few eps), and the bound
    is taken relative to the tensor's scale, as sums of many terms cancel."""
    eps = torch.finfo(dtype).eps
    tol = 8 * (layers + 1) * eps if dtype == torch.float32 else 4 * (layers + 1) * eps
    for x, want in zip(got, exact, strict=True):
        scale = float(want.abs().max()) if want.numel() else 1.0
        torch.testing.assert_close(x.double(), want, rtol=tol, atol=tol * scale)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "b,k,r,layers",
    [(1, 7, 7, 1), (1, 33, 5, 3), (5, 27, 27, 3), (13, 45, 9, 1), (3, 999, 4, 3)],
    ids=["b1-full-rank-l1", "b1-low-rank-l3", "odd-k-full-rank-l3", "low-rank-l1", "k999-two-blocks"],
)
def test_gemm_path_forward_and_backward_match_reference(b, k, r, layers, dtype):
    """The GEMM path (library matmuls + fused elementwise kernels) against the float64 reference,
    forward and every gradient; 16-bit also within a small factor of eager PyTorch's own error."""
    seed = 100 + b + k + r + layers
    inputs = _inputs(b, k, r, layers, dtype, seed)
    grad = torch.randn(b, k, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    got = _forward_and_grads(lambda *t: dcnv2_cross(*t, backend="triton", kernel="gemm"), inputs, grad)
    exact = _forward_and_grads(dcnv2_cross_reference, [t.double() for t in inputs], grad)
    assert [t.dtype for t in got] == [dtype] * 5 and got[0].shape == (b, k)
    _assert_close_to_exact(got, exact, dtype, layers)
    if dtype != torch.float32:
        # Triton's interpreter truncates float32 to bfloat16 (CUDA rounds to nearest).
        factor = 4 if DEVICE == "cpu" else 2
        eager = _forward_and_grads(dcnv2_cross_reference, inputs, grad)
        for name, x, e, want in zip(["out", "dx0", "du", "dv", "db"], got, eager, exact, strict=True):
            assert _rel_err(x, want) < factor * _rel_err(e, want) + 1e-3, name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemm_elementwise_kernels_match_torch_across_program_blocks(dtype):
    """x0 * y + x forward, and (g * x0, acc + g * y [+ g]) backward, over a length that
    spans several programs and ends in a partial one."""
    from recaccel.ops.interaction.dcnv2_gemm import cross_backward_pass, cross_elementwise

    gen = torch.Generator().manual_seed(21)
    x0, y, x, g = (torch.randn(3, 1705, generator=gen).to(DEVICE, dtype) for _ in range(4))
    acc = torch.randn(3, 1705, generator=gen).to(DEVICE)
    f32 = [t.float() for t in (x0, y, x, g)]
    tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(
        cross_elementwise(x0, y, x).float(), (f32[0] * f32[1] + f32[2]).to(dtype).float(), **tol
    )
    dy, out, _ = cross_backward_pass(g, x0, y, acc, final=False)
    assert dy.dtype == dtype and out.dtype == torch.float32
    torch.testing.assert_close(dy.float(), (f32[3] * f32[0]).to(dtype).float(), **tol)
    torch.testing.assert_close(out, acc + f32[3] * f32[1], rtol=1e-6, atol=1e-6)
    dy, out, _ = cross_backward_pass(g, x0, y, None, final=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), (f32[3] * f32[1] + f32[3]).to(dtype).float(), **tol)


@needs_triton
def test_gemm_path_under_bf16_autocast_matches_fp32_within_bf16_error():
    inputs = _inputs(6, 40, 8, 3, seed=22)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = dcnv2_cross(*[t.bfloat16() for t in inputs], backend="triton", kernel="gemm")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dcnv2_cross_reference(*inputs), rtol=0.05, atol=0.05)


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="unknown kernel 'cutlass'"):
        dcnv2_cross(*_inputs(2, 4, 2, 1, device="cpu"), backend="reference", kernel="cutlass")


@needs_triton
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_non_contiguous_inputs_and_expanded_grad(kernel):
    x0, u, v, b = _inputs(6, 10, 4, 2, seed=6)
    x0_t = x0.t().contiguous().t()  # [B, K] with column-major storage
    u_t = u.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x0_t.is_contiguous() and not u_t.is_contiguous()
    torch.testing.assert_close(
        dcnv2_cross(x0_t, u_t, v, b, "triton", kernel), dcnv2_cross_reference(x0, u, v, b)
    )
    leaves = [t.detach().requires_grad_() for t in (x0_t, u_t, v, b)]
    dcnv2_cross(*leaves, backend="triton", kernel=kernel).sum().backward()  # grad_out expanded: strides 0
    ref_leaves = [t.detach().requires_grad_() for t in (x0, u, v, b)]
    dcnv2_cross_reference(*ref_leaves).sum().backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad)


@needs_triton
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_empty_batch_and_partial_grads(kernel):
    x0, u, v, b = _inputs(0, 8, 2, 2)
    assert dcnv2_cross(x0, u, v, b, "triton", kernel).shape == (0, 8)
    x0, u, v, b = _inputs(4, 8, 2, 2, seed=7)
    w = u.detach().requires_grad_()  # only u needs a gradient
    (gu,) = torch.autograd.grad(dcnv2_cross(x0, w, v, b, "triton", kernel).sum(), w)
    wr = u.detach().requires_grad_()
    (gu_ref,) = torch.autograd.grad(dcnv2_cross_reference(x0, wr, v, b).sum(), wr)
    torch.testing.assert_close(gu, gu_ref)


@needs_triton
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_second_order_matches_reference(kernel):
    x0, u, v, b = _inputs(3, 8, 3, 2, seed=8)

    def grad_norm(fn, x):
        (gx,) = torch.autograd.grad(fn(x, u, v, b).square().sum(), x, create_graph=True)
        return gx.square().sum()

    x = x0.detach().requires_grad_()
    (gg,) = torch.autograd.grad(grad_norm(lambda *t: dcnv2_cross(*t, "triton", kernel), x), x)
    (gg_ref,) = torch.autograd.grad(grad_norm(dcnv2_cross_reference, x), x)
    torch.testing.assert_close(gg, gg_ref, rtol=1e-4, atol=1e-4)  # float32 sums in another order


def test_auto_is_reference_on_cpu_and_float64():
    x0, u, v, b = _inputs(3, 6, 2, 2, torch.float64, seed=9, device="cpu")
    torch.testing.assert_close(dcnv2_cross(x0, u, v, b), dcnv2_cross_reference(x0, u, v, b), rtol=0, atol=0)


def test_init_cross_weights_shapes_and_scale():
    u, v, b = init_cross_weights(300, 3, 50, torch.Generator().manual_seed(0))
    assert u.shape == (3, 300, 50) and v.shape == (3, 50, 300) and b.shape == (3, 300)
    assert not b.any()
    assert abs(float(u.std()) - (2 / 350) ** 0.5) < 0.01


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((2, 4), (1, 4, 2), (1, 2, 4), (1, 5)), "disagree"),
        (((2, 4), (1, 4, 2), (1, 2, 5), (1, 4)), "disagree"),
        (((2, 4, 1), (1, 4, 2), (1, 2, 4), (1, 4)), r"x0 \[B, K\]"),
        (((2, 4), (0, 4, 2), (0, 2, 4), (0, 4)), "L, K, r >= 1"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    with pytest.raises(ValueError, match=match):
        dcnv2_cross(*[torch.zeros(s) for s in shapes], backend="reference")


def test_mixed_dtypes_and_unknown_backend_raise():
    x0, u, v, b = _inputs(2, 4, 2, 1, device="cpu")
    with pytest.raises(ValueError, match="one dtype"):
        dcnv2_cross(x0.double(), u, v, b)
    with pytest.raises(ValueError, match="not implemented"):
        dcnv2_cross(x0, u, v, b, backend="fbgemm")


@needs_triton
def test_triton_rejects_float64():
    with pytest.raises(ValueError, match="float64"):
        dcnv2_cross(*_inputs(2, 4, 2, 1, torch.float64), backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mlperf_size_half(dtype):
    """MLPerf DLRM-DCNv2's cross network (K = 128 * 27, rank 512, 3 layers) in 16 bits."""
    _check_triton(4096, 128 * 27, 512, 3, dtype, seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("b,k,r,layers", [(1, 7, 1, 1), (16384, 432, 64, 2), (1000, 3456, 512, 3)])
def test_gpu_matches_reference_fp32_ieee(b, k, r, layers):
    with tf32(False):
        _check_triton(b, k, r, layers, torch.float32, seed=12)
