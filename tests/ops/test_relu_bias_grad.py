"""ReLU's backward and the bias gradient in one Triton pass, against aten's two ops
(``threshold_backward``, then the column sum), on fresh seeded inputs; and the fused MLP
layer's backward through it (forced on here: on its own it runs on CUDA only)."""

from __future__ import annotations

import pytest
import torch

from recaccel.models import fused_linear
from recaccel.models.fused_linear import linear_relu
from recaccel.ops.relu_bias_grad import relu_bias_grad, relu_bias_grad_reference
from tests.helpers.marks import needs_triton

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient and a ReLU-like output: half its entries exactly 0, some negative (a
    mask is a mask whatever produced it), the rest positive."""
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(rows, cols, generator=gen).to(dtype)
    out = torch.randn(rows, cols, generator=gen)
    out = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, torch.zeros_like(out), out).to(dtype)
    return grad, out


def _assert_sums_close(got: torch.Tensor, g: torch.Tensor) -> None:
    """float32 column sums in another order: within n units of float32 times the sum of
    magnitudes (Higham's bound for any summation order)."""
    want = g.double().sum(0)
    bound = g.shape[0] * 2.0**-24 * g.double().abs().sum(0) + 1e-30
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert bool(((got.double() - want).abs() <= bound).all()), (got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rows", "cols"),
    [(1, 1), (1, 128), (7, 13), (130, 129), (257, 512), (33, 1000)],
)
def test_one_pass_is_threshold_backward_and_its_column_sums(rows, cols, dtype):
    grad, out = _inputs(rows, cols, dtype, seed=rows * 1000 + cols)
    g, db = relu_bias_grad(grad, out)
    want_g, _ = relu_bias_grad_reference(grad, out)
    assert g.dtype == dtype
    torch.testing.assert_close(g, want_g, rtol=0, atol=0)  # a select: bit for bit
    _assert_sums_close(db, want_g)


def test_edge_inputs_empty_batch_non_contiguous_and_nan():
    empty, db = relu_bias_grad(torch.empty(0, 5), torch.empty(0, 5))
    assert empty.shape == (0, 5) and torch.equal(db, torch.zeros(5))
    grad, out = _inputs(40, 24, torch.float32, seed=3)
    g, db = relu_bias_grad(grad.t(), out.t())  # transposed views: taken contiguous
    torch.testing.assert_close(g, relu_bias_grad_reference(grad.t(), out.t())[0], rtol=0, atol=0)
    # aten's rule for NaN: a NaN output passes its gradient, a NaN gradient at a dead unit is 0.
    grad[0, 0], out[0, 0] = 1.5, float("nan")
    grad[1, 1], out[1, 1] = float("nan"), 0.0
    g, db = relu_bias_grad(grad, out)
    want, _ = relu_bias_grad_reference(grad, out)
    torch.testing.assert_close(g, want, rtol=0, atol=0, equal_nan=True)
    assert g[0, 0] == 1.5 and g[1, 1] == 0.0


def _layer_grads(x, weight, bias, grad_out, autocast: bool):
    x, weight, bias = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = linear_relu(x, weight, bias)
    out.backward(grad_out.to(out.dtype))
    return out, x.grad, weight.grad, bias.grad


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_fused_layer_backward_through_the_one_pass_kernel_is_autograds(autocast, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    x, weight, bias = (
        torch.randn(96, 40, generator=gen),
        torch.randn(136, 40, generator=gen),
        torch.randn(136),
    )
    grad_out = torch.randn(96, 136, generator=gen)
    want = _layer_grads(x, weight, bias, grad_out, autocast)
    calls = []

    def counted(grad, out):
        calls.append(grad.shape)
        return relu_bias_grad(grad, out)

    monkeypatch.setattr(fused_linear, "one_pass_relu_backward", lambda grad: True)
    monkeypatch.setattr(fused_linear, "relu_bias_grad", counted)
    got = _layer_grads(x, weight, bias, grad_out, autocast)
    assert calls == [torch.Size([96, 136])]
    # Outputs and the x / weight gradients: the same GEMMs on the same (bit-equal) mask;
    # the bias gradient: float32 sums in another order, rounded to the layer's dtype.
    tol = {"rtol": 1.6e-2, "atol": 1e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


def test_a_differentiated_backward_keeps_autograds_ops(monkeypatch):
    """Second order (the meta engines): the one-pass kernel has no derivative, so a backward
    run with grad mode on takes aten's differentiable ops, and the Hessian-vector product is
    torch's."""
    modes = []

    def recorded(grad, out):
        modes.append(torch.is_grad_enabled())
        return relu_bias_grad(grad, out)

    monkeypatch.setattr(fused_linear, "one_pass_relu_backward", lambda grad: True)
    monkeypatch.setattr(fused_linear, "relu_bias_grad", recorded)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 6, generator=gen)
    weight = torch.randn(5, 6, generator=gen, requires_grad=True)
    bias = torch.randn(5, generator=gen, requires_grad=True)

    def loss(w, b):
        return (linear_relu(x, w, b) ** 2).sum()

    def plain_loss(w, b):
        return (torch.relu(x @ w.t() + b) ** 2).sum()

    (gw,) = torch.autograd.grad(loss(weight, bias), weight, create_graph=True)
    (hvp,) = torch.autograd.grad(gw.sum(), bias)
    (gw_plain,) = torch.autograd.grad(plain_loss(weight, bias), weight, create_graph=True)
    (hvp_plain,) = torch.autograd.grad(gw_plain.sum(), bias)
    torch.testing.assert_close(hvp, hvp_plain, rtol=1e-5, atol=1e-5)
    assert True not in modes


def test_the_one_pass_applies_to_2d_cuda_gradients_of_the_kernels_dtypes_only():
    assert not fused_linear.one_pass_relu_backward(torch.zeros(4, 3))  # CPU: aten's ops
    if torch.cuda.is_available():
        assert fused_linear.one_pass_relu_backward(torch.zeros(4, 3, device="cuda", dtype=torch.bfloat16))
        assert not fused_linear.one_pass_relu_backward(torch.zeros(4, 3, device="cuda", dtype=torch.float64))
        assert not fused_linear.one_pass_relu_backward(torch.zeros(2, 4, 3, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_one_pass_at_the_criteo_heads_widths(dtype):
    """B=65,536 rows by the widths of bench_criteo_1hot's layers, on CUDA, and a rerun bit for bit."""
    for cols in (512, 256, 128, 1024):
        grad, out = (t.cuda() for t in _inputs(65536, cols, dtype, seed=cols))
        g, db = relu_bias_grad(grad, out)
        want_g, _ = relu_bias_grad_reference(grad, out)
        torch.testing.assert_close(g, want_g, rtol=0, atol=0)
        _assert_sums_close(db.cpu(), want_g.cpu())
        assert torch.equal(relu_bias_grad(grad, out)[1], db)  # strips summed in a fixed order


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_split_layer_defers_the_same_one_pass_gradients_bit_for_bit(autocast, monkeypatch):
    """The overlapped step's split layer (wgrad deferred to a queue) gives the fused layer's
    gradients bit for bit with the one-pass kernel too: the mask, the bias sums, the GEMMs."""
    from recaccel.models.fused_linear import dense_layer
    from recaccel.models.split_linear import WgradQueue, split_dense_layer

    monkeypatch.setattr(fused_linear, "one_pass_relu_backward", lambda grad: True)
    gen = torch.Generator().manual_seed(12)
    x0, grad_out = torch.randn(64, 13, generator=gen), torch.randn(64, 24, generator=gen)
    w0, b0 = torch.randn(24, 13, generator=gen), torch.randn(24, generator=gen)
    grads = []
    for split in (False, True):
        x, weight, bias = (torch.nn.Parameter(t.clone()) for t in (x0, w0, b0))
        queue = WgradQueue()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if split:
                out = split_dense_layer(x, weight, bias, relu=True, fused=True, align=True, queue=queue)
            else:
                out = dense_layer(x, weight, bias, relu=True, fused=True, align=True)
        out.backward(grad_out.to(out.dtype))
        queue.run()
        grads.append((x.grad, weight.grad, bias.grad))
    for unsplit, split in zip(*grads, strict=True):
        assert torch.equal(unsplit, split)


def test_the_custom_op_and_its_fake_rule_agree_for_torch_compile():
    """``torch.compile`` (a compiled dense head) traces the op through its fake rule:
    torch.library's own consistency checks, and a compiled call equal to the eager one."""
    grad, out = _inputs(33, 40, torch.float32, seed=8)
    torch.library.opcheck(relu_bias_grad, (grad, out), test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda g, o: relu_bias_grad(g, o), backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(grad, out), relu_bias_grad(grad, out), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_compiled_fused_layer_traces_its_backward_through_the_custom_op(monkeypatch):
    """A compiled dense head (train.compile): the layer's backward graph holds the one-pass
    op (traced through its fake rule) and its gradients are eager's."""
    monkeypatch.setattr(fused_linear, "one_pass_relu_backward", lambda grad: True)
    gen = torch.Generator().manual_seed(9)
    x, weight, bias = torch.randn(48, 24, generator=gen), torch.randn(40, 24, generator=gen), torch.randn(40)
    want = _layer_grads(x, weight, bias, torch.ones(48, 40), autocast=False)
    traced = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def keep(graph, _):
            traced.append(str(graph.graph))
            return graph

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    layer = torch.compile(lambda *a: linear_relu(*a).sum(), backend=backend, fullgraph=True)
    params = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    layer(*params).backward()
    assert any("relu_bias_grad" in g for g in traced)
    for got, w in zip((p.grad for p in params), want[1:], strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
