"""The dense optimizer from ``[optim]``, over the parameters autograd updates (MLPs,
non-fused embeddings), with ``optim.grad_clip_norm``'s clipping. The sparse one is fused
into the embeddings and configured by
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
    """An optimizer over ``model.parameters()``, clipping their gradients first when
    ``cfg.grad_clip_norm > 0`` (see :func:`clip_before_step`).

    Fused embeddings keep their weights as buffers and update them inside backward,
    so they never appear here. ``cfg.dense`` is one of the choices (OptimConfig checks it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _DENSE[cfg.dense](params, cfg)
    if cfg.grad_clip_norm > 0:
        clip_before_step(optimizer, cfg.grad_clip_norm)
    return optimizer


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Makes every ``optimizer.step()`` first scale its parameters' gradients to a global
    L2 norm of at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``).

    A step pre-hook: it runs wherever the step is taken, after backward (single process,
    every pipeline and micro-batch mode) and in hybrid mode after the dense gradients'
    allreduce, so every rank clips the same summed gradients the same way. Only the
    dense optimizer's parameters count; the sparse rows are updated inside backward.
    """

    def clip(opt: torch.optim.Optimizer, args, kwargs) -> None:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)

    optimizer.register_step_pre_hook(clip)
