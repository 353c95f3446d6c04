"""Step observers: the parts of a run that watch its steps without being the loop.

The Trainer holds one :class:`StepObservers` list: its own (the embedding caches' meter,
the profiler, fault injection) and those its ``Parallelism`` hands over through
``observers()`` (hybrid: the straggler policy and the communication monitor). The loop
calls the list at fixed points and never looks inside a parallelism:

- ``on_start(step)``: training starts (or resumes) with ``step`` steps done;
- ``before_step(step, batch)``: step ``step`` (1-based) is about to train ``batch`` on
  this rank (called by the parallelism once every rank agreed on the step; TorchRec's
  pipelined hybrid steps train batches taken steps earlier and do not call it);
- ``after_step(step, done)``: step ``step`` is done; returns the :class:`Note` s (log
  events, console lines) it has to report;
- ``log_fields(step)``: fields a ``train`` event of ``step`` adds;
- ``on_checkpoint(step)``: the checkpoint of ``step`` is written;
- ``final_metrics()``: entries of the run's final metrics (metrics.json);
- ``close()``: the run ends or stops;
- ``state_dict()`` / ``load_state_dict(state)``: what an observer would carry over a resume.

:class:`StepObserver` gives every hook a no-op default, so an observer writes only the
hooks it needs (as torchtitan's components do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class StepDone:
    """One finished optimizer step.

    Attributes:
        loss: the step loss (detached scalar; the global mean in hybrid mode).
        reader_state: the reader position after the step's batch.
        rows: training rows of the step over all ranks.
    """

    loss: Tensor
    reader_state: dict[str, Any]
    rows: int


@dataclass
class Note:
    """Something an observer reports after a step.

    Attributes:
        kind: the log event's kind (``straggler``, ``monitor``, ``flag``).
        fields: the event's fields.
        text: a console line (``%`` arguments in ``args``), or None for none.
        args: the line's arguments.
        warning: show the line as a warning (seen by default from Python too).
    """

    kind: str
    fields: dict[str, Any]
    text: str | None = None
    args: tuple[Any, ...] = ()
    warning: bool = False


class StepObserver:
    """A named watcher of training steps; every hook does nothing unless overridden."""

    name = "observer"

    def on_start(self, step: int) -> None:
        """Training starts with ``step`` steps done."""

    def before_step(self, step: int, batch: Any) -> None:
        """Step ``step`` is about to train ``batch`` (this rank's)."""

    def after_step(self, step: int, done: StepDone) -> Iterable[Note]:
        """Step ``step`` is done; returns what it has to report."""
        return ()

    def log_fields(self, step: int) -> dict[str, Any]:
        """Fields of the ``train`` event of ``step``."""
        return {}

    def on_checkpoint(self, step: int) -> None:
        """The checkpoint of ``step`` is written."""

    def final_metrics(self) -> dict[str, Any]:
        """Entries of the run's final metrics."""
        return {}

    def close(self) -> None:
        """The run ends or stops (may be called more than once)."""

    def state_dict(self) -> dict[str, Any]:
        """What this observer would carry over a resume (nothing by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s result."""


@dataclass
class StepObservers:
    """The observers of one run, called in order; notes go to ``report`` as they come.

    Args:
        observers: the observers (names need not be unique, lookups take the first).
        report: called with each note an observer returns (default: dropped).
    """

    observers: list[StepObserver] = field(default_factory=list)
    report: Callable[[Note], None] = lambda note: None
    step: int = 0  # steps done, as of the last on_start / after_step

    def add(self, observer: StepObserver) -> None:
        """Appends ``observer`` (it sees the steps from the next one on)."""
        self.observers.append(observer)

    def names(self) -> list[str]:
        return [o.name for o in self.observers]

    def on_start(self, step: int) -> None:
        self.step = step
        for o in self.observers:
            o.on_start(step)

    def before_step(self, batch: Any) -> None:
        """Called by the parallelism before the step it is about to train (the next one)."""
        for o in self.observers:
            o.before_step(self.step + 1, batch)

    def after_step(self, step: int, done: StepDone) -> None:
        self.step = step
        for o in self.observers:
            for note in o.after_step(step, done):
                self.report(note)

    def log_fields(self, step: int) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for o in self.observers:
            fields.update(o.log_fields(step))
        return fields

    def on_checkpoint(self, step: int) -> None:
        for o in self.observers:
            o.on_checkpoint(step)

    def final_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for o in self.observers:
            out.update(o.final_metrics())
        return out

    def close(self) -> None:
        for o in self.observers:
            o.close()

    def state_dict(self) -> dict[str, Any]:
        """Each observer's non-empty state, by name."""
        return {o.name: s for o in self.observers if (s := o.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for o in self.observers:
            if o.name in state:
                o.load_state_dict(state[o.name])


class BatchCallback(StepObserver):
    """Calls ``fn(step, batch)`` with each batch this rank is about to train (benchmarks and
    tests record the rows each rank trained and when).

    Args:
        fn: called before each step with its number and this rank's batch.
        name: the observer's name.
    """

    def __init__(self, fn: Callable[[int, Any], None], name: str = "batches") -> None:
        self.fn = fn
        self.name = name

    def before_step(self, step: int, batch: Any) -> None:
        self.fn(step, batch)
