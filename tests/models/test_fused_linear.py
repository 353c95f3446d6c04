"""The MLP fast path (bias + ReLU in the GEMM epilogue, aligned inner dimensions) against
plain ``nn.Linear`` + ``nn.ReLU``, forward and backward, on fresh seeded inputs.

On the CPU the fast path is off by default (the plain path keeps today's bits); these
tests switch it on explicitly, so the same code that runs on CUDA is checked here too.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from recaccel.models.arches import MLP, DenseArch, OverArch, mlp
from recaccel.models.fused_linear import aligned_operands, linear_relu, padded_width

# float32: the same GEMM, possibly blocked differently; bfloat16: 8 significant bits.
FP32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}


def _plain(layers: MLP) -> nn.Sequential:
    """The same layers as a plain ``nn.Sequential`` (today's module), same weights."""
    return nn.Sequential(*copy.deepcopy(list(layers)))


def _fast(layers: MLP, *, fused: bool = True, align: bool = True) -> MLP:
    layers.fused, layers.align = fused, align
    return layers


def _grads(module: nn.Module, x: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor) -> list:
    params = [x, *module.parameters()]
    return torch.autograd.grad(out, params, grad_out)


def _forward_backward(module: nn.Module, x: torch.Tensor, grad_out_seed: int, autocast: bool):
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(out.dtype)
    return out, _grads(module, x, out, grad_out)


@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("in_features", [13, 16, 37])
def test_fast_mlp_matches_linear_then_relu_in_fp32_forward_and_backward(batch, in_features):
    torch.manual_seed(batch * 100 + in_features)
    fast = _fast(mlp(in_features, [24, 9, 4], final_activation=True))
    plain = _plain(fast)
    x = torch.randn(batch, in_features)
    out, grads = _forward_backward(fast, x, 1, autocast=False)
    ref_out, ref_grads = _forward_backward(plain, x, 1, autocast=False)
    torch.testing.assert_close(out, ref_out, **FP32)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("batch", [1, 33])
def test_fast_mlp_matches_linear_then_relu_under_bf16_autocast(batch):
    torch.manual_seed(batch)
    fast = _fast(mlp(13, [32, 16], final_activation=True))
    plain = _plain(fast)
    x = torch.randn(batch, 13)
    out, grads = _forward_backward(fast, x, 2, autocast=True)
    ref_out, ref_grads = _forward_backward(plain, x, 2, autocast=True)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, **BF16)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype == torch.float32  # master weights and input stay fp32
        torch.testing.assert_close(got, want, **BF16)


def test_units_dead_on_every_row_get_zero_gradients():
    torch.manual_seed(3)
    x = torch.randn(6, 5, requires_grad=True)
    weight = torch.randn(4, 5, requires_grad=True)
    bias = torch.tensor([-1e3, 0.0, 1e3, -1e3], requires_grad=True)  # units 0 and 3 never fire
    out = linear_relu(x, weight, bias)
    out.sum().backward()
    assert torch.equal(out[:, [0, 3]], torch.zeros(6, 2))
    assert torch.equal(weight.grad[[0, 3]], torch.zeros(2, 5))
    assert torch.equal(bias.grad[[0, 3]], torch.zeros(2))
    assert bias.grad[2] == 6.0  # always live: one per row


def test_fused_layer_has_exact_first_and_second_derivatives():
    # The meta engines differentiate through the adapted head a second time.
    gen = torch.Generator().manual_seed(4)
    args = tuple(
        torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
        for shape in ((7, 5), (3, 5), (3,))
    )
    assert torch.autograd.gradcheck(linear_relu, args)
    assert torch.autograd.gradgradcheck(linear_relu, args)


def test_fused_layer_without_autograd_equals_the_plain_layer():
    torch.manual_seed(5)
    x, weight, bias = torch.randn(9, 13), torch.randn(6, 13), torch.randn(6)
    with torch.no_grad():
        torch.testing.assert_close(linear_relu(x, weight, bias), torch.relu(x @ weight.t() + bias), **FP32)


def test_padded_bottom_mlp_equals_the_unpadded_math_and_keeps_its_13_column_weight():
    torch.manual_seed(6)
    padded = _fast(mlp(13, [16, 8], final_activation=True), fused=False, align=True)
    plain = _plain(padded)
    x = torch.randn(10, 13)
    out, grads = _forward_backward(padded, x, 3, autocast=False)
    ref_out, ref_grads = _forward_backward(plain, x, 3, autocast=False)
    torch.testing.assert_close(out, ref_out, **FP32)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32)
    assert padded[0].weight.shape == (16, 13) and grads[1].shape == (16, 13)


def test_an_input_already_padded_to_eight_columns_meets_zero_weights():
    torch.manual_seed(7)
    layers = _fast(mlp(13, [8], final_activation=True))
    x = torch.randn(4, 13)
    wide = torch.cat([x, torch.full((4, padded_width(13) - 13), 123.0)], dim=1)  # padding contents ignored
    torch.testing.assert_close(layers(wide), layers(x), **FP32)


def test_an_input_of_neither_width_is_refused():
    with pytest.raises(ValueError, match="13 inputs got 15 columns"):
        aligned_operands(torch.zeros(2, 15), torch.zeros(4, 13))


def test_aligned_widths_are_left_as_they_are():
    x, weight = torch.randn(3, 16), torch.randn(5, 16)
    assert aligned_operands(x, weight) == (x, weight)


def test_mlp_keeps_the_plain_sequential_state_dict():
    layers = mlp(13, [16, 8, 1], final_activation=False)
    plain = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
    assert {k: v.shape for k, v in layers.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    layers.load_state_dict(plain.state_dict(), strict=True)


def test_mlp_on_cpu_by_default_gives_todays_bits():
    torch.manual_seed(8)
    layers = mlp(13, [32, 16], final_activation=True)
    assert layers.fused is None and layers.align is None  # the default: fast path on CUDA only
    x = torch.randn(17, 13)
    assert torch.equal(layers(x), _plain(layers)(x))


@pytest.mark.parametrize("autocast", [False, True])
def test_fast_over_arch_matches_its_plain_layers_with_an_fp32_logit(autocast):
    torch.manual_seed(9)
    arch = OverArch(37, [24, 8, 1])
    _fast(arch.model)
    plain = _plain(arch.model)
    x = torch.randn(11, 37)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = arch(x)
        hidden = plain[:-1](x)
    want = plain[-1](hidden.float()).squeeze(-1)
    assert logits.dtype == torch.float32 and logits.shape == (11,)
    torch.testing.assert_close(logits, want, **(BF16 if autocast else FP32))


def test_fast_dense_arch_matches_its_plain_layers():
    torch.manual_seed(10)
    arch = DenseArch(13, [16, 8])
    _fast(arch.model)
    x = torch.randn(1, 13)
    torch.testing.assert_close(arch(x), _plain(arch.model)(x), **FP32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mlp_takes_the_fast_path_and_matches_linear_then_relu(dtype):
    torch.manual_seed(11)
    layers = mlp(13, [64, 32], final_activation=True).cuda()
    plain = _plain(layers)
    x = torch.randn(257, 13, device="cuda")
    tol = BF16 if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}  # TF32 may be on
    outs = []
    for module in (layers, plain):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = module(xi)
        grad_out = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        outs.append((out, _grads(module, xi, out, grad_out.to(out.dtype))))
    (out, grads), (ref_out, ref_grads) = outs
    torch.testing.assert_close(out, ref_out, **tol)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_the_models_import_and_train_a_layer_without_triton():
    """Triton is optional: with it unimportable, the MLP layers still build and train on CPU
    (the one-pass ReLU backward is simply off)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from recaccel.models import fused_linear\n"
        "from recaccel.models.arches import mlp\n"
        "assert fused_linear.relu_bias_grad is None\n"
        "layers = mlp(13, [8, 4], final_activation=True)\n"
        "layers.fused, layers.align = True, True\n"
        "layers(torch.randn(5, 13)).sum().backward()\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
