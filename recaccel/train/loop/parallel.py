"""How a run is spread over processes: the strategy a Trainer delegates to.

:class:`SingleProcess` is one process on one device; :class:`recaccel.train.distributed.hybrid.
HybridParallel` shards embeddings through TorchRec and sums dense gradients over ranks.
The Trainer calls the same methods on either, so its loop has no mode branches;
:func:`recaccel.train.loop.trainer.build_parallel` picks one from ``parallel.mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from recaccel.config import TrainConfig
from recaccel.io.readers.protocol import Reader
from recaccel.train.checkpoint.state import TrainState, load_checkpoint, save_checkpoint
from recaccel.train.loop.observers import StepDone, StepObserver, StepObservers
from recaccel.train.loop.pipeline import BatchPipeline
from recaccel.train.loop.preemption import pending_signal
from recaccel.train.loop.runner import StepRunner
from recaccel.train.loop.step import build_step
from recaccel.train.model.objectives import Objective

__all__ = ["BatchWithState", "Parallelism", "SingleProcess", "StepDone"]

# (batch, reader position after it): what the device loader hands the training loop.
BatchWithState = tuple[Any, dict[str, Any]]


class Parallelism(Protocol):
    """The process layout a Trainer runs under."""

    rank: int
    world_size: int
    device: torch.device
    step_rows: int  # training rows of the last step, over all ranks

    @property
    def is_main(self) -> bool: ...

    def wrap(self, module: nn.Module) -> nn.Module: ...

    def reader(self, make: Callable[[int, int], Reader], *, train: bool) -> Reader: ...

    def steps(
        self,
        source: Iterable[BatchWithState],
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        train: TrainConfig,
        observers: StepObservers | None = None,
    ) -> Iterator[StepDone]:
        """Trains on ``source``'s batches, one optimizer step each, as ``train.pipeline``
        and ``train.micro_batches`` say; calls ``observers.before_step`` with each batch
        about to train; yields after each step."""
        ...

    def observers(self) -> list[StepObserver]:
        """The step observers this layout brings (hybrid: straggler policy, monitor)."""
        ...

    def sparse_rate_setters(self) -> list[Callable[[float], None]]:
        """Setters of the rates of sparse optimizers this layout owns (beyond the model's)."""
        ...

    def gather(self, tensor: Tensor) -> Tensor: ...

    def stop_requested(self) -> str | None:
        """The stop signal (``"SIGTERM"``, ``"SIGINT"``) every rank acts on after the step
        just yielded, or None: all ranks get the same answer (:mod:`recaccel.train.loop.preemption`)."""
        ...

    def save_checkpoint(
        self,
        run_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        keep: int = 2,
    ) -> Path | None: ...

    def load_checkpoint(
        self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> TrainState: ...

    def step_figures(self) -> dict[str, Any]:
        """What the run's step runner did, for metrics.json (a whole-step CUDA graph's
        graphed and eager steps); empty where there is nothing to say."""
        ...

    def close(self) -> None: ...


def _as_given(batch: Any) -> Any:
    return batch


class SingleProcess:
    """One process, one device: wrapping and gathering are identities."""

    rank = 0
    world_size = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_rows = 0
        self._kept_runner: tuple[Objective, TrainConfig, StepRunner] | None = None

    @property
    def is_main(self) -> bool:
        return True

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def reader(self, make: Callable[[int, int], Reader], *, train: bool) -> Reader:
        return make(0, 1)

    def steps(
        self,
        source: Iterable[BatchWithState],
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        train: TrainConfig,
        observers: StepObservers | None = None,
    ) -> Iterator[StepDone]:
        """The batches through the :class:`BatchPipeline` of ``train.pipeline``, each
        stepped by the runner of :func:`recaccel.train.loop.step.build_step` (which
        prepares them itself when it captures the whole step)."""
        runner = self._runner(train, objective)
        prepare = _as_given if runner.prepares_in_step else objective.prepare
        pipeline = BatchPipeline(prepare, self.device, train.pipeline, objective.batches_ahead)
        for item in pipeline(source):
            self.step_rows = item.batch.training_rows
            if observers is not None:
                observers.before_step(item.batch)
            loss = runner.train_step(item, optimizer)
            yield StepDone(loss, item.reader_state, self.step_rows)

    def _runner(self, train: TrainConfig, objective: Objective) -> StepRunner:
        """The step runner of ``train``: a persistent one (a captured whole step) is kept
        for the next call with the same objective and settings; others are built afresh."""
        kept = self._kept_runner
        if kept is not None and kept[0] is objective and kept[1] == train:
            return kept[2]
        runner = build_step(train, objective, self.device)
        self._kept_runner = (objective, train, runner) if runner.persistent else None
        return runner

    def observers(self) -> list[StepObserver]:
        return []

    def sparse_rate_setters(self) -> list[Callable[[float], None]]:
        return []

    def step_figures(self) -> dict[str, Any]:
        kept = self._kept_runner
        return {} if kept is None else kept[2].figures()

    def gather(self, tensor: Tensor) -> Tensor:
        """Concatenates a per-rank [N, ...] tensor over ranks (here: itself)."""
        return tensor

    def stop_requested(self) -> str | None:
        """The stop signal this process got (there are no other ranks to agree with)."""
        return pending_signal()

    def save_checkpoint(
        self,
        run_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        keep: int = 2,
    ) -> Path:
        return save_checkpoint(run_dir, model, optimizer, state, keep)

    def load_checkpoint(
        self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> TrainState:
        return load_checkpoint(run_dir, model, optimizer, self.device)

    def close(self) -> None:
        pass
