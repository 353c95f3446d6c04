"""What runs one training step: the :class:`StepRunner` protocol and the eager runners' base.

Shapes: B batch.
"""

from __future__ import annotations

import abc
from typing import Protocol

import torch
from torch import Tensor

from recaccel.train.loop.pipeline import StepInput


class StepRunner(Protocol):
    """Runs one training step."""

    prepares_in_step: bool  # batches come unprepared: the step prepares them itself
    persistent: bool  # kept by the loop across its calls (a captured graph lives in it)

    def figures(self) -> dict:
        """What the runner did over the run, for metrics.json (a persistent one's)."""
        ...

    def train_step(self, item: StepInput, optimizer: torch.optim.Optimizer) -> Tensor:
        """The whole step, the dense optimizer's included; returns the detached step loss."""
        ...


class EagerStep(abc.ABC):
    """A step as forward and backward (:meth:`forward_backward`, the runner's own) between
    the dense optimizer's ``zero_grad`` and ``step``."""

    prepares_in_step = False
    persistent = False

    @abc.abstractmethod
    def forward_backward(self, item: StepInput) -> Tensor:
        """Leaves the step's gradients (and any fused sparse update) applied; returns
        the detached step loss."""

    def figures(self) -> dict:
        return {}  # an eager step has nothing to report beyond the run's own figures

    def train_step(self, item: StepInput, optimizer: torch.optim.Optimizer) -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(item)
        optimizer.step()
        return loss
