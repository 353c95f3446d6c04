"""[optim] becomes the optimizers in one place: the dense builder and the fused sparse
optimizer's settings that every embedding backend (recaccel, TorchRec/FBGEMM, replicated
tables) reads."""

from __future__ import annotations

import pytest
import torch

from recaccel.config import DenseOptimizer, OptimConfig, ShardingKind, choices
from recaccel.ops.embedding import SparseOptimConfig
from recaccel.train.optim import build_dense_optimizer


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
