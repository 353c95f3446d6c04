"""The trainer's pieces for one ``recaccel`` candidate, built by the trainer's own builders.

The trainer itself needs a run directory and a dataset; the benchmark times its loop on
batches it made. So this calls the same builders :class:`~recaccel.train.loop.trainer.Trainer`
calls (the layout of :func:`~recaccel.train.loop.trainer.build_parallel`, the loss of
:func:`~recaccel.train.loop.trainer.resolve_loss`, the head of
:func:`~recaccel.train.model.dense_head.build_head`, the runner of
:func:`~recaccel.train.loop.step.build_step`, the optimizer of
:func:`~recaccel.train.model.optim.build_dense_optimizer`) and the config's rules, in the
trainer's order: a combination the trainer refuses is refused here with the same line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from recaccel.config import Config, TrainConfig
from recaccel.config.rules import check_rules
from recaccel.sparse import Batch
from recaccel.train.loop.parallel import Parallelism, StepDone
from recaccel.train.loop.step import build_step
from recaccel.train.loop.trainer import build_parallel, resolve_loss
from recaccel.train.model.dense_head import build_head
from recaccel.train.model.objectives import DLRMObjective
from recaccel.train.model.optim import build_dense_optimizer

# The benchmark's batches are synthetic clicks: binary labels, as the eager baseline's loss.
LABEL_KIND = "binary"


@dataclass
class TrainerParts:
    """What the trainer's loop of a ``recaccel`` candidate runs (the timeline annotates them).

    Attributes:
        model: the DLRM (shared by the candidate's combinations).
        objective: the DLRM objective with this combination's head.
        optimizer: the dense optimizer.
        train: the ``[train]`` section of the combination.
        layout: the process layout whose ``steps`` is the trainer's loop (one process).
    """

    model: nn.Module
    objective: DLRMObjective
    optimizer: torch.optim.Optimizer
    train: TrainConfig
    layout: Parallelism

    def steps(self, source: Iterable[tuple[Batch, dict]]) -> Iterator[StepDone]:
        """The trainer's loop over (batch, reader position) pairs."""
        return self.layout.steps(source, self.objective, self.optimizer, self.train)


def trainer_parts(cfg: Config, model: nn.Module, device: torch.device) -> TrainerParts:
    """The layout, objective, dense optimizer and loop the trainer builds for ``cfg`` on ``model``.

    Raises:
        ConfigError: the trainer refuses ``cfg`` here (its one line: CUDA graphs on a CPU,
            semi-sync with micro-batches, micro-batches on an embedding that cannot defer
            its update, a rule between sections, a key that needs hybrid mode).
    """
    check_rules(cfg)
    layout = build_parallel(cfg, device)
    loss = resolve_loss(cfg, LABEL_KIND)
    objective = DLRMObjective(cfg, model, loss, head=build_head(model, cfg.train, device))
    build_step(cfg.train, objective, device)  # the runner's own refusals, before any step
    optimizer = build_dense_optimizer(objective.module, cfg.optim)
    return TrainerParts(model, objective, optimizer, cfg.train, layout)
