"""The dense optimizer from ``[optim]``, over the parameters autograd updates (MLPs,
non-fused embeddings). The sparse one is fused into the embeddings and configured by
:meth:`recaccel.ops.embedding.SparseOptimConfig.from_config`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from recaccel.config import DenseOptimizer, OptimConfig

_DENSE: dict[DenseOptimizer, Callable[[list[nn.Parameter], OptimConfig], torch.optim.Optimizer]] = {
    "adam": lambda params, cfg: torch.optim.Adam(
        params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay
    ),
    "sgd": lambda params, cfg: torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay),
    "adagrad": lambda params, cfg: torch.optim.Adagrad(
        params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay
    ),
}


def build_dense_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """An optimizer over ``model.parameters()``.

    Fused embeddings keep their weights as buffers and update them inside backward,
    so they never appear here. ``cfg.dense`` is one of the choices (OptimConfig checks it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return _DENSE[cfg.dense](params, cfg)
