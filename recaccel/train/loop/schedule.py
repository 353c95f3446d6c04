"""Learning-rate schedules of the dense and the sparse optimizer (``[optim]``).

The rate of the step with 0-based index ``k`` is ``base * lr_factor(k, total, cfg)``
(``base``: ``optim.lr`` for the dense optimizer, ``optim.sparse_lr`` for the sparse one):

- warmup: ``(k + 1) / warmup_steps`` while ``k < warmup_steps`` (linear from 0; the
  first step already moves, as MLPerf's DLRM reference and torch's ``LinearLR`` with
  ``start_factor = 1 / warmup_steps``);
- then 1 until ``decay_start`` (0: right after the warmup);
- then, with ``t = (k - decay_start) / decay_steps`` clamped to [0, 1] and
  ``r = final_lr_ratio``: ``r + (1 - r) * s(t)``, ``s`` being ``1 - t`` (linear),
  ``(1 + cos(pi t)) / 2`` (cosine) or ``(1 - t) ** poly_power`` (polynomial, the shape
  of MLPerf's DLRM reference); ``decay_steps = 0`` decays until the run's last step;
- ``constant``: no decay (the warmup still applies).

The factor is a function of the step alone, so a resumed run follows the schedule of
an uninterrupted one with nothing saved beyond the step count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recaccel.config import OptimConfig
from recaccel.errors import ConfigError
from recaccel.ops.embedding import PackedEmbeddingBag

if TYPE_CHECKING:
    from recaccel.train.loop.parallel import Parallelism

_SHAPES: dict[str, Callable[[float, float], float]] = {
    "linear": lambda t, power: 1.0 - t,
    "cosine": lambda t, power: 0.5 * (1.0 + math.cos(math.pi * t)),
    "polynomial": lambda t, power: (1.0 - t) ** power,
}


@dataclass(frozen=True)
class Decay:
    """Where the decay of a schedule lies, in 0-based steps: ``start`` .. ``start + steps``."""

    start: int
    steps: int


def resolve_decay(cfg: OptimConfig, total_steps: int | None) -> Decay | None:
    """The decay of ``cfg``'s schedule in a run of ``total_steps`` steps (None: no decay).

    Raises:
        ConfigError: a decay start inside the warmup; ``decay_steps = 0`` (until the end)
            in a run whose length is unknown, or that ends before the decay starts.
    """
    if cfg.schedule == "constant":
        return None
    start = cfg.decay_start if cfg.decay_start > 0 else cfg.warmup_steps
    if start < cfg.warmup_steps:
        raise ConfigError(
            f"optim.decay_start={cfg.decay_start} lies inside the warmup (optim.warmup_steps="
            f"{cfg.warmup_steps}); set optim.decay_start >= {cfg.warmup_steps} or 0 (right after it)"
        )
    if cfg.decay_steps > 0:
        return Decay(start, cfg.decay_steps)
    if total_steps is None:
        raise ConfigError(
            f"optim.schedule={cfg.schedule} with optim.decay_steps=0 decays until the run's last step, "
            "but the run's length is unknown (the reader cannot count its batches); set optim.decay_steps "
            "or train.steps"
        )
    if total_steps <= start:
        raise ConfigError(
            f"optim.schedule={cfg.schedule} with optim.decay_steps=0 decays from step {start} to the run's "
            f"last step, but the run has {total_steps} steps; lower optim.decay_start / optim.warmup_steps "
            "or set optim.decay_steps"
        )
    return Decay(start, total_steps - start)


def lr_factor(step: int, total_steps: int | None, cfg: OptimConfig) -> float:
    """The multiplier of the base learning rates for the step of 0-based index ``step``.

    Args:
        step: steps already taken (the step this factor is for has that index).
        total_steps: the run's length in steps (None when unknown; needed only for a
            decay with ``decay_steps = 0``).
        cfg: the ``[optim]`` section.

    Raises:
        ConfigError: see :func:`resolve_decay`.
    """
    return _factor(step, cfg, resolve_decay(cfg, total_steps))


def _factor(step: int, cfg: OptimConfig, decay: Decay | None) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if decay is None or step < decay.start:
        return 1.0
    t = min((step - decay.start) / decay.steps, 1.0)
    ratio = cfg.final_lr_ratio
    return ratio + (1.0 - ratio) * _SHAPES[cfg.schedule](t, cfg.poly_power)


def is_scheduled(cfg: OptimConfig) -> bool:
    """Whether ``cfg`` changes any rate during a run (a warmup or a decay)."""
    return cfg.schedule != "constant" or cfg.warmup_steps > 0


class LRSchedule:
    """Applies :func:`lr_factor` to the dense optimizer's groups and to every sparse
    optimizer before each step.

    Without a warmup or a decay (:func:`is_scheduled` false) it changes nothing, so a
    run keeps the rates it had (bit-identical to a run without schedules).

    Args:
        cfg: the ``[optim]`` section.
        total_steps: the run's length in steps (None when unknown).
        dense: the dense optimizer; each group gets ``cfg.lr * factor``.
        sparse: setters of the sparse rate, each called with ``cfg.sparse_lr * factor``
            (see :func:`sparse_rate_setters`).

    Raises:
        ConfigError: see :func:`resolve_decay`; a schedule that would bring the sparse
            rate to 0 on a step of the run (the fused sparse optimizers need a rate > 0).
    """

    def __init__(
        self,
        cfg: OptimConfig,
        total_steps: int | None,
        dense: torch.optim.Optimizer,
        sparse: list[Callable[[float], None]],
    ) -> None:
        self.cfg = cfg
        self.active = is_scheduled(cfg)
        self.decay = resolve_decay(cfg, total_steps)
        self.dense = dense
        self.sparse = sparse
        self._applied: float | None = None
        end = None if self.decay is None else self.decay.start + self.decay.steps
        if sparse and end is not None and cfg.final_lr_ratio == 0 and total_steps is not None:
            if end < total_steps:
                raise ConfigError(
                    f"optim.final_lr_ratio=0 brings the sparse rate to 0 at step {end + 1} of {total_steps} "
                    "(the fused sparse optimizers need a rate > 0); set optim.final_lr_ratio > 0 or "
                    "optim.decay_steps=0 (decay until the run's last step)"
                )

    def factor(self, step: int) -> float:
        """The factor of the step of 0-based index ``step`` (1 when nothing is scheduled)."""
        return _factor(step, self.cfg, self.decay) if self.active else 1.0

    def rates(self, step: int) -> tuple[float, float]:
        """The (dense, sparse) rates of the step of 0-based index ``step``."""
        f = self.factor(step)
        return self.cfg.lr * f, self.cfg.sparse_lr * f

    def apply(self, step: int) -> None:
        """Sets the rates of the step of 0-based index ``step`` (before its forward: a
        fused embedding applies its sparse update inside backward).

        Raises:
            ConfigError: the sparse rate would be 0 (a decay to ``final_lr_ratio = 0``
                that ends before the run does).
        """
        if not self.active:
            return
        f = self.factor(step)
        if f == self._applied:
            return
        dense, sparse = self.cfg.lr * f, self.cfg.sparse_lr * f
        if self.sparse and not sparse > 0:
            raise ConfigError(
                f"the schedule brings optim.sparse_lr to 0 at step {step + 1} (optim.final_lr_ratio=0 "
                "and the decay ends before the run); set optim.final_lr_ratio > 0 or optim.decay_steps"
            )
        set_group_rates(self.dense, dense)
        for setter in self.sparse:
            setter(sparse)
        self._applied = f


def sparse_rate_setters(module: nn.Module, parallel: Parallelism) -> list[Callable[[float], None]]:
    """Setters of every sparse optimizer's rate in a run.

    - recaccel's packed embeddings in ``module`` (their fused optimizer, any depth);
    - those the process layout owns (``parallel.sparse_rate_setters()``; hybrid mode:
      TorchRec's fused optimizer of the sharded tables, see :func:`set_fused_rate`, and
      the optimizer of the replicated ``data_parallel`` tables).
    """
    setters: list[Callable[[float], None]] = [
        m.set_learning_rate for m in module.modules() if isinstance(m, PackedEmbeddingBag)
    ]
    return setters + parallel.sparse_rate_setters()


def set_group_rates(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets every group's ``lr`` of ``optimizer``; a rate held in a tensor (a captured
    step's optimizer: :class:`~recaccel.train.loop.step_graph.GraphedStep`) is refilled in
    place, on the current stream, so the graph's replays read it."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def set_fused_rate(optimizer: Any, lr: float) -> None:
    """TorchRec's fused optimizer: the groups' rate reaches FBGEMM's kernels on ``step``
    (which updates nothing: the rows were updated inside backward), as TorchRec's own
    ``WarmupOptimizer`` does."""
    set_group_rates(optimizer, lr)
    optimizer.step()
