"""Dense optimizers for the parameters autograd updates (MLPs, non-fused embeddings)."""

from __future__ import annotations

import torch
from torch import nn

from recaccel.config import OptimConfig
from recaccel.errors import ConfigError


def build_dense_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """An optimizer over ``model.parameters()``.

    Fused embeddings keep their weights as buffers and update them inside backward,
    so they never appear here.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.dense == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.dense == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    raise ConfigError(f"optim.dense must be adam, sgd or adagrad, got {cfg.dense!r}")
