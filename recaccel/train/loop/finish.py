"""What a finished run reports: the figures of metrics.json and its final event beyond
the evaluation's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recaccel.config import TrainConfig
from recaccel.train.checkpoint.best import summary
from recaccel.train.checkpoint.state import TrainState
from recaccel.train.loop.data_wait import DataWait
from recaccel.train.run.runlog import read_events


def run_figures(
    state: TrainState, wait: DataWait, seconds_before: float, counters: dict[str, int], train: TrainConfig
) -> dict[str, Any]:
    """The run's totals: steps, epochs, rows, throughput, last loss, data waits, the
    reader counters (``counters``: the reader's own, when no step paired its position
    with them) and the best-metric summary.

    Args:
        state: the state after the last step.
        wait: the run's data wait.
        seconds_before: ``state.train_seconds`` when this fit began (a resumed run's share).
        counters: the reader's counters.
        train: the run's ``[train]``.
    """
    return dict(
        steps=state.step,
        epochs=state.epoch,
        train_samples=state.samples,
        samples_per_s=state.samples / max(state.train_seconds, 1e-9),
        train_loss=state.last_loss,
        data_wait_s=wait.seconds,
        data_startup_s=wait.startup_seconds,
        data_wait_fraction=wait.fraction(state.train_seconds - seconds_before),
        data=dict(state.data) if state.data is not None else dict(counters),
        **summary(state.best, train),
    )


def incidents(run_dir: Path) -> dict[str, int]:
    """How many times the ranks were restarted and how many monitor flags were raised over
    the whole run (resumed stretches included), from its log."""
    kinds = [event.get("event") for event in read_events(run_dir)]
    return {"restarts": kinds.count("restart"), "flags": kinds.count("flag")}
