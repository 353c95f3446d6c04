"""Step observers (issue 28): the Trainer calls one list at fixed points, the layout hands
over its own observers, and neither the loop nor the layouts keep a second stepping path."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from recaccel.config import load_config
from recaccel.train.loop.observers import BatchCallback, Note, StepDone, StepObserver, StepObservers
from recaccel.train.loop.parallel import SingleProcess
from recaccel.train.loop.trainer import Trainer
from tests.helpers.dlrm_run import overrides


class _Journal(StepObserver):
    """Records every hook call; reports a note every 4th step."""

    name = "journal"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_start(self, step: int) -> None:
        self.calls.append(("start", step))

    def before_step(self, step: int, batch: Any) -> None:
        self.calls.append(("before", step, batch.training_rows))

    def after_step(self, step: int, done: StepDone) -> list[Note]:
        self.calls.append(("after", step, done.rows))
        return [Note("journal", {"step": step}, "journal at %d", (step,))] if step % 4 == 0 else []

    def log_fields(self, step: int) -> dict[str, Any]:
        return {"journal_calls": len(self.calls)}

    def on_checkpoint(self, step: int) -> None:
        self.calls.append(("checkpoint", step))

    def final_metrics(self) -> dict[str, Any]:
        return {"journal_steps": sum(1 for c in self.calls if c[0] == "after")}

    def close(self) -> None:
        self.calls.append(("close",))


def test_the_loop_calls_every_hook_in_step_order_and_logs_the_notes(tiny_data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    cfg = load_config(None, overrides(tiny_data, out, "train.steps=8", "train.checkpoint_every=4"))
    journal = _Journal()
    metrics = Trainer(cfg, observers=[journal]).fit()

    assert journal.calls[0] == ("start", 0)
    steps = [c for c in journal.calls if c[0] in ("before", "after")]
    assert steps == [(kind, s, 256) for s in range(1, 9) for kind in ("before", "after")]
    assert [c for c in journal.calls if c[0] == "checkpoint"] == [
        ("checkpoint", 4),
        ("checkpoint", 8),
        ("checkpoint", 8),
    ]
    assert ("close",) in journal.calls
    assert metrics["journal_steps"] == 8
    events = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "journal"] == [4, 8]
    trains = [e for e in events if e["event"] == "train"]
    assert trains and all("journal_calls" in e for e in trains)


def test_the_trainer_lists_its_own_observers_then_the_callers(tiny_data, tmp_path):  # noqa: F811
    cfg = load_config(None, overrides(tiny_data, tmp_path / "run"))
    seen: list[int] = []
    trainer = Trainer(cfg, observers=[BatchCallback(lambda step, batch: seen.append(step))])
    assert trainer.observers.names() == ["cache", "profiler", "fault", "batches"]


def test_a_resumed_run_starts_its_observers_at_the_saved_step(tiny_data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    Trainer(load_config(None, overrides(tiny_data, out, "train.steps=4"))).fit()
    journal = _Journal()
    Trainer(
        load_config(None, overrides(tiny_data, out, "train.steps=6")), resume=True, observers=[journal]
    ).fit()
    assert journal.calls[0] == ("start", 4)
    assert [c[1] for c in journal.calls if c[0] == "before"] == [5, 6]


def test_observer_list_reports_notes_in_observer_order():
    reported: list[str] = []

    class Says(StepObserver):
        def __init__(self, word: str) -> None:
            self.name = word

        def after_step(self, step: int, done: StepDone) -> list[Note]:
            return [Note(self.name, {"step": step})]

    observers = StepObservers([Says("a"), Says("b")], lambda note: reported.append(note.kind))
    observers.after_step(1, StepDone(torch.tensor(0.0), {}, 1))
    assert reported == ["a", "b"]
    assert observers.state_dict() == {}


def test_single_process_has_one_stepping_path_and_no_observers_of_its_own():
    layout = SingleProcess(torch.device("cpu"))
    assert layout.observers() == [] and layout.sparse_rate_setters() == []
    for dead in ("batches", "train_step"):
        assert not hasattr(layout, dead)


@pytest.mark.parametrize("kill_at", [0, 3])
def test_kill_rank_is_an_observer_that_only_the_named_rank_and_step_trip(kill_at):
    from recaccel.train.distributed.faults import KillRank

    fault = load_config(None, [f"fault.kill_rank_at_step={kill_at}", "fault.kill_rank=1"]).fault
    done = StepDone(torch.tensor(0.0), {}, 1)
    for step in range(1, 6):
        assert KillRank(fault, rank=0).after_step(step, done) == ()  # rank 0 is never killed
    assert KillRank(fault, rank=1).step == kill_at
