"""``train.profile_steps = [first, last]``: torch.profiler over those steps of a run.

The Chrome trace (CPU ops; CUDA kernels, copies and streams on a GPU) is written as
``profile-steps-<first>-<last>.json`` in the run directory, each step labelled
:data:`STEP_LABEL`. ``recaccel-train`` then draws its per-thread and per-stream
timeline next to it as ``.png`` (``recaccel.plotting.profile.draw_profile`` does
the same from Python).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from recaccel.train.loop.observers import Note, StepDone, StepObserver

logger = logging.getLogger(__name__)

STEP_LABEL = "recaccel/train-step"


def trace_path(run_dir: Path, steps: list[int] | tuple[int, ...]) -> Path:
    """Where the trace of ``steps`` = [first, last] goes in ``run_dir``."""
    return Path(run_dir) / f"profile-steps-{steps[0]}-{steps[1]}.json"


class StepProfiler(StepObserver):
    """Profiles steps ``first..last`` (1-based, inclusive) of the training loop.

    A step observer: :meth:`at` runs with the number of steps done when training starts
    and after every step: it starts profiling before step ``first`` and writes the trace
    after ``last``.
    A run resumed past ``first`` profiles nothing.

    Args:
        run_dir: the run directory.
        steps: ``[first, last]`` (``[]``: a profiler that does nothing).
        device: the training device (CUDA adds the CUDA activity).
    """

    def __init__(self, run_dir: Path, steps: list[int], device: torch.device) -> None:
        self.path = trace_path(run_dir, steps) if steps else None
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self._activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self._activities.append(ProfilerActivity.CUDA)
        self._prof: profile | None = None
        self._label: record_function | None = None

    name = "profiler"

    def on_start(self, step: int) -> None:
        self.at(step)

    def after_step(self, step: int, done: StepDone) -> tuple[Note, ...]:
        self.at(step)
        return ()

    def at(self, done: int) -> Path | None:
        """After ``done`` steps: starts, labels the next step, or stops; returns the trace's
        path when it was just written."""
        if self.path is None:
            return None
        if self._prof is None and done == self.first - 1:
            self._prof = profile(activities=self._activities)
            self._prof.__enter__()
        if self._prof is None:
            return None
        if self._label is not None:
            self._label.__exit__(None, None, None)
            self._label = None
        if done >= self.last:
            return self._write()
        self._label = record_function(STEP_LABEL)
        self._label.__enter__()
        return None

    def close(self) -> None:
        """Stops a profile still running (the run ended or stopped first), writing nothing."""
        if self._label is not None:
            self._label.__exit__(None, None, None)
            self._label = None
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def _write(self) -> Path:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        logger.info("profile of steps %d-%d written to %s", self.first, self.last, self.path)
        return self.path
