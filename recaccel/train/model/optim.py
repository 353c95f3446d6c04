"""The dense optimizer from ``[optim]``, over the parameters autograd updates (MLPs,
non-fused embeddings), with ``optim.grad_clip_norm``'s clipping. The sparse one is fused
into the embeddings and configured by
:meth:`recaccel.ops.embedding.SparseOptimConfig.from_config`.

Implementation (:func:`implementation`): torch's single-pass ``fused=True`` kernels for
Adam and SGD when every parameter is a floating-point CUDA tensor (one launch per step
instead of a dozen ``foreach`` passes); torch's default otherwise, which is ``foreach``
on CUDA (Adagrad: torch has no fused CUDA kernel for it) and the per-tensor loop on the
CPU (so CPU runs and their checkpoints are what they were). The choice follows where the
run is, not where a checkpoint was written: loading an optimizer state re-applies it
(:func:`keep_run_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from recaccel.config import DenseOptimizer, OptimConfig

# Optimizers with a fused CUDA kernel in torch (Adagrad's fused kernel is CPU-only).
_FUSED_ON_CUDA: frozenset[DenseOptimizer] = frozenset({"adam", "sgd"})

_DENSE: dict[DenseOptimizer, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda params, cfg, **impl: torch.optim.Adam(
        params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, **impl
    ),
    "sgd": lambda params, cfg, **impl: torch.optim.SGD(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, **impl
    ),
    "adagrad": lambda params, cfg, **impl: torch.optim.Adagrad(
        params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, **impl
    ),
}


def implementation(
    kind: DenseOptimizer, devices: Iterable[torch.device], *, floating: bool = True
) -> dict[str, bool | None]:
    """The torch implementation flags for optimizer ``kind`` over parameters on ``devices``.

    Args:
        kind: ``optim.dense``.
        devices: the parameters' devices.
        floating: every parameter is floating point (torch's fused kernels need it).

    Returns:
        ``{"fused": True, "foreach": False}`` where torch has a fused CUDA kernel for
        ``kind`` and every parameter is a floating-point CUDA tensor, else
        ``{"fused": None, "foreach": None}`` (torch's default).
    """
    devices = [torch.device(d) for d in devices]
    on_cuda = bool(devices) and floating and all(d.type == "cuda" for d in devices)
    if kind in _FUSED_ON_CUDA and on_cuda:
        return {"fused": True, "foreach": False}
    return {"fused": None, "foreach": None}


def build_dense_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """An optimizer over ``model.parameters()`` in the :func:`implementation` for their
    device, clipping their gradients first when ``cfg.grad_clip_norm > 0`` (see
    :func:`clip_before_step`).

    Fused embeddings keep their weights as buffers and update them inside backward,
    so they never appear here. ``cfg.dense`` is one of the choices (OptimConfig checks it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    impl = implementation(
        cfg.dense, [p.device for p in params], floating=all(p.is_floating_point() for p in params)
    )
    optimizer = _DENSE[cfg.dense](params, cfg, **impl)
    keep_run_settings(optimizer, impl)
    if cfg.grad_clip_norm > 0:
        clip_before_step(optimizer, cfg.grad_clip_norm)
    return optimizer


# The groups' hyper-parameters the [optim] config sets (build_dense_optimizer's factories).
_CONFIG_KEYS = ("lr", "eps", "weight_decay")


def keep_run_settings(optimizer: torch.optim.Optimizer, impl: dict[str, bool | None]) -> None:
    """Makes ``optimizer.load_state_dict`` keep what this run chose, where torch would take
    the saved groups':

    - ``impl``, the ``fused`` / ``foreach`` flags (a CPU run's must not reach a CUDA run). A
      fused or capturable optimizer keeps each ``step`` count as a float32 tensor on its
      parameter's device, the others on the CPU; the loaded counts are moved to match,
      values unchanged.
    - the hyper-parameters it was built with (``optim.lr``, ``optim.eps``,
      ``optim.weight_decay``): ``--resume RUN --set optim.lr=...`` trained on at the
      checkpoint's rate while config.toml recorded the new one. Unchanged, they are the saved
      values: resume stays exact. A rate held in a tensor (a captured step's) is refilled in place.
    """
    built = {k: optimizer.defaults[k] for k in _CONFIG_KEYS if k in optimizer.defaults}

    def reapply(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            group.update(impl)
            for key, value in built.items():
                if isinstance(group.get(key), torch.Tensor):
                    group[key].fill_(value)
                else:
                    group[key] = value
            fused = bool(impl["fused"] or group.get("capturable", False))
            for p in group["params"]:
                step = opt.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    opt.state[p]["step"] = _step_for(step, p, fused=fused)

    optimizer.register_load_state_dict_post_hook(reapply)


def _step_for(step: torch.Tensor, param: torch.Tensor, *, fused: bool) -> torch.Tensor:
    if fused:
        return step.to(dtype=torch.float32, device=param.device)
    return step.to(device="cpu")


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Makes every ``optimizer.step()`` first scale its parameters' gradients to a global
    L2 norm of at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``).

    A step pre-hook: it runs wherever the step is taken, after backward (single process,
    every pipeline and micro-batch mode) and in hybrid mode after the dense gradients'
    allreduce, so every rank clips the same summed gradients the same way. Only the
    dense optimizer's parameters count; the sparse rows are updated inside backward.
    The norm before clipping is kept as ``optimizer.grad_norm`` (a 0-d tensor, not synced:
    the trainer reads it at log steps only).
    """

    def clip(opt: torch.optim.Optimizer, args, kwargs) -> None:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if params:
            opt.grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)

    optimizer.register_step_pre_hook(clip)
