"""Training: the loop (:class:`Trainer`), what it optimizes (objectives), the process
layout it runs under (single process here, hybrid in :mod:`recaccel.train.distributed`),
checkpoints and the run directory.

Names resolve on first use, so ``import recaccel.train`` imports neither torch nor
TorchRec (``import recaccel`` stays light).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recaccel.lazy import lazy_exports

if TYPE_CHECKING:
    from recaccel.train.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from recaccel.train.checkpoint_paths import all_checkpoints, list_checkpoints, newest_checkpoint
    from recaccel.train.objectives import DLRMObjective, MetaObjective, Objective
    from recaccel.train.optim import build_dense_optimizer
    from recaccel.train.parallel import Parallelism, SingleProcess
    from recaccel.train.runlog import RunLog
    from recaccel.train.trainer import Trainer, build_parallel, resolve_device, resolve_loss

# Each public name and the submodule defining it (imported on first use).
_EXPORTS = {
    "Trainer": "trainer",
    "build_parallel": "trainer",
    "resolve_device": "trainer",
    "resolve_loss": "trainer",
    "Objective": "objectives",
    "DLRMObjective": "objectives",
    "MetaObjective": "objectives",
    "Parallelism": "parallel",
    "SingleProcess": "parallel",
    "TrainState": "checkpoint",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "list_checkpoints": "checkpoint_paths",
    "all_checkpoints": "checkpoint_paths",
    "newest_checkpoint": "checkpoint_paths",
    "build_dense_optimizer": "optim",
    "RunLog": "runlog",
}

__all__ = [
    "DLRMObjective",
    "MetaObjective",
    "Objective",
    "Parallelism",
    "RunLog",
    "SingleProcess",
    "TrainState",
    "Trainer",
    "all_checkpoints",
    "build_dense_optimizer",
    "build_parallel",
    "list_checkpoints",
    "load_checkpoint",
    "newest_checkpoint",
    "resolve_device",
    "resolve_loss",
    "save_checkpoint",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
