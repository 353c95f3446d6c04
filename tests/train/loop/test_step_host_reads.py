"""A training run's steps never read the device between log steps.

On a GPU every read of a device value on the host (``.item()``, ``int(t)``, a
``nonzero``...) drains the queue the step built: the kernels that follow wait for the
host. The trainer reads the loss and the deferred bounds check at log steps only; this
runs the whole loop (loader, pipeline, step, fused sparse update, dense optimizer) on
the CPU with the Triton kernels interpreted, records every host read of a tensor's value
made by the main thread (:mod:`tests.helpers.host_reads`) and asserts that the steps
between log steps made none. Reads of the loader's thread (host batches) and of torch's
optimizers' step counters (host tensors unless capturable) are not device reads.
"""

from __future__ import annotations

import pytest

import recaccel.train.loop.trainer as trainer_module
from recaccel.cli import train_main
from tests.helpers.dlrm_run import overrides, set_args
from tests.helpers.host_reads import host_reads
from tests.helpers.marks import needs_triton

pytestmark = needs_triton

STEPS = 6
MARK = "step done"


def _reads_between_log_steps(tiny_data, tmp_path, monkeypatch, *extra: str) -> list[str]:
    """The host reads of steps 3 .. STEPS (step 1 logs; step 2 may still compile)."""
    record = trainer_module.Trainer._record_step
    with host_reads(main_thread_only=True, depth=3, ignore=("torch/optim/",)) as seen:

        def marked(self, done):
            seen.append(MARK)
            return record(self, done)

        monkeypatch.setattr(trainer_module.Trainer, "_record_step", marked)
        sets = overrides(
            tiny_data,
            tmp_path / "run",
            'model.embedding_backend="triton"',
            f"train.steps={STEPS}",
            "train.log_every=1000",
            "train.eval_every=0",
            "data.batch_size=64",
            *extra,
        )
        assert train_main(set_args(sets)) == 0
    marks = [i for i, s in enumerate(seen) if s == MARK]
    assert len(marks) == STEPS
    return [s for s in seen[marks[1] + 1 : marks[-1]] if s != MARK]


@pytest.mark.parametrize(
    "pipeline",
    [
        ('train.pipeline="off"',),
        ('train.pipeline="sync"', "train.micro_batches=2"),
        ('train.pipeline="semi_sync"',),
        ('train.pipeline="overlap"',),
    ],
    ids=["off", "sync-2-micro-batches", "semi_sync", "overlap"],
)
def test_training_steps_between_log_steps_never_read_the_device(pipeline, tiny_data, tmp_path, monkeypatch):
    assert _reads_between_log_steps(tiny_data, tmp_path, monkeypatch, *pipeline) == []


def test_the_recorder_sees_a_read_the_step_makes(tiny_data, tmp_path, monkeypatch):
    """The check can fail: a loss read every step (as a careless logger would) is seen."""
    step = trainer_module.Trainer._record_step

    def reads_the_loss(self, done):
        float(done.loss)
        return step(self, done)

    monkeypatch.setattr(trainer_module.Trainer, "_record_step", reads_the_loss)
    seen = _reads_between_log_steps(tiny_data, tmp_path, monkeypatch)
    assert len(seen) == STEPS - 2 and all(s.startswith("__float__ at test_step_host_reads.py") for s in seen)
