"""[optim] becomes the optimizers in one place: the dense builder and the fused sparse
optimizer's settings that every embedding backend (recaccel, TorchRec/FBGEMM, replicated
tables) reads."""

from __future__ import annotations

import copy

import pytest
import torch

from recaccel.config import DenseOptimizer, OptimConfig, ShardingKind, choices
from recaccel.ops.embedding import SparseOptimConfig
from recaccel.train.model.optim import build_dense_optimizer, implementation


@pytest.mark.parametrize("dense", choices(DenseOptimizer))
def test_every_dense_choice_builds_its_optimizer(dense):
    cfg = OptimConfig(dense=dense, lr=0.25, weight_decay=0.5)
    model = torch.nn.Linear(3, 1)
    model.bias.requires_grad_(False)
    opt = build_dense_optimizer(model, cfg)
    expected = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[dense]
    assert type(opt) is expected
    (group,) = opt.param_groups
    assert group["lr"] == 0.25 and group["weight_decay"] == 0.5
    assert group["params"] == [model.weight]  # frozen parameters are left out


def test_sparse_settings_come_from_optim_config():
    rule = SparseOptimConfig.from_config(OptimConfig(sparse_lr=0.3, eps=1e-6))
    assert rule == SparseOptimConfig(lr=0.3, eps=1e-6)


def test_fbgemm_fused_params_read_the_sparse_settings():
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from recaccel.train.distributed.sharding import fused_params

    optim = OptimConfig(sparse="adam", sparse_lr=0.3, eps=1e-6)
    params = fused_params(optim, torch.device("cuda"))  # only the device kind is read
    rule = SparseOptimConfig.from_config(optim)
    assert params == {
        "optimizer": EmbOptimType.ADAM,
        "learning_rate": rule.lr,
        "eps": rule.eps,
        "beta1": rule.beta1,
        "beta2": rule.beta2,
    }
    assert fused_params(OptimConfig(sparse="sgd"), torch.device("cpu"))["optimizer"] == EmbOptimType.EXACT_SGD


def test_sharding_kinds_are_configs():
    from recaccel.train.distributed import sharding

    assert sharding.KINDS == choices(ShardingKind)
    assert "data_parallel" not in sharding._AUTO_KINDS and set(sharding._AUTO_KINDS) < set(sharding.KINDS)


CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("dense", ["adam", "sgd"])
def test_adam_and_sgd_take_the_fused_kernel_when_every_parameter_is_on_cuda(dense):
    assert implementation(dense, [CUDA, CUDA]) == {"fused": True, "foreach": False}


@pytest.mark.parametrize(
    ("dense", "devices", "floating"),
    [
        ("adagrad", [CUDA], True),  # torch's fused Adagrad is CPU-only
        ("adam", [CPU], True),  # the per-tensor loop: CPU runs keep their bits and checkpoints
        ("adam", [CUDA, CPU], True),
        ("sgd", [CUDA], False),  # fused kernels need floating-point parameters
        ("adam", [], True),
    ],
)
def test_everything_else_keeps_torchs_default_implementation(dense, devices, floating):
    assert implementation(dense, devices, floating=floating) == {"fused": None, "foreach": None}


@pytest.mark.parametrize("dense", choices(DenseOptimizer))
def test_a_cpu_optimizer_reports_torchs_default_in_its_defaults(dense):
    opt = build_dense_optimizer(torch.nn.Linear(3, 1), OptimConfig(dense=dense))
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None


def _trained(model: torch.nn.Module, cfg: OptimConfig, steps: int) -> torch.optim.Optimizer:
    opt = build_dense_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 5, generator=gen)).square().mean().backward()
        opt.step()
    return opt


def test_a_state_written_by_a_fused_run_resumes_in_the_cpu_implementation():
    torch.manual_seed(0)
    cfg = OptimConfig(dense="adam", lr=0.1, weight_decay=0.01)
    model = torch.nn.Linear(5, 2)
    saved = _trained(model, cfg, steps=3).state_dict()
    as_if_cuda = copy.deepcopy(saved)
    for group in as_if_cuda["param_groups"]:
        group.update(fused=True, foreach=False)  # what a CUDA run writes

    twins = []
    for state in (saved, as_if_cuda):
        twin = copy.deepcopy(model)
        opt = build_dense_optimizer(twin, cfg)
        opt.load_state_dict(state)
        assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(None, None)]
        assert all(s["step"].device == CPU and s["step"].item() == 3 for s in opt.state.values())
        twin(torch.ones(1, 5)).sum().backward()
        opt.step()
        twins.append(twin)
    for a, b in zip(twins[0].parameters(), twins[1].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_a_cuda_run_resumes_a_cpu_state_in_the_fused_implementation():
    torch.manual_seed(0)
    cfg = OptimConfig(dense="adam", lr=0.1, weight_decay=0.01)
    model = torch.nn.Linear(5, 2)
    saved = _trained(model, cfg, steps=3).state_dict()
    cuda_model = copy.deepcopy(model).cuda()
    opt = build_dense_optimizer(cuda_model, cfg)
    assert opt.defaults["fused"] is True
    opt.load_state_dict(saved)
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(True, False)]
    for s in opt.state.values():
        assert s["step"].device.type == "cuda" and s["step"].dtype == torch.float32 and s["step"].item() == 3
    x = torch.ones(1, 5)
    cpu_opt = build_dense_optimizer(model, cfg)
    cpu_opt.load_state_dict(saved)
    for m, o, xi in ((model, cpu_opt, x), (cuda_model, opt, x.cuda())):
        # deepcopy left the copy without the last training step's gradients: start both at none.
        o.zero_grad()
        m(xi).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), cuda_model.parameters(), strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
