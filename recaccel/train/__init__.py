"""Training: the loop (:class:`Trainer`), what it optimizes (objectives), the process
layout it runs under (single process here, hybrid in :mod:`recaccel.train.distributed`),
checkpoints and the run directory.

Names resolve on first use, so ``import recaccel.train`` imports neither torch nor
TorchRec (``import recaccel`` stays light).
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from recaccel.lazy import lazy_exports

if TYPE_CHECKING:
    from recaccel.train.checkpoint.paths import all_checkpoints, list_checkpoints, newest_checkpoint
    from recaccel.train.checkpoint.state import TrainState, load_checkpoint, save_checkpoint
    from recaccel.train.loop.parallel import Parallelism, SingleProcess
    from recaccel.train.loop.trainer import Trainer, build_parallel, resolve_device, resolve_loss
    from recaccel.train.model.objectives import DLRMObjective, MetaObjective, Objective
    from recaccel.train.model.optim import build_dense_optimizer
    from recaccel.train.run.runlog import RunLog

# Each public name and the submodule defining it (imported on first use).
_EXPORTS = {
    "Trainer": "loop.trainer",
    "build_parallel": "loop.trainer",
    "resolve_device": "loop.trainer",
    "resolve_loss": "loop.trainer",
    "Objective": "model.objectives",
    "DLRMObjective": "model.objectives",
    "MetaObjective": "model.objectives",
    "Parallelism": "loop.parallel",
    "SingleProcess": "loop.parallel",
    "TrainState": "checkpoint.state",
    "save_checkpoint": "checkpoint.state",
    "load_checkpoint": "checkpoint.state",
    "list_checkpoints": "checkpoint.paths",
    "all_checkpoints": "checkpoint.paths",
    "newest_checkpoint": "checkpoint.paths",
    "build_dense_optimizer": "model.optim",
    "RunLog": "run.runlog",
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


class _TrainPackage(types.ModuleType):
    """``recaccel.train`` names both this package and the API's training function.

    ``recaccel`` binds the package, made callable as :func:`recaccel.api.train`: were the
    function bound there instead, ``import recaccel.train.loop.trainer as t`` (which walks
    the attributes) would find the function and fail.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from recaccel.api import train

        return train(*args, **kwargs)

    @property
    def __signature__(self) -> Any:  # inspect.signature(recaccel.train): the function's
        import inspect

        from recaccel.api import train

        return inspect.signature(train)


sys.modules[__name__].__class__ = _TrainPackage
