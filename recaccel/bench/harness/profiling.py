"""Profiled steps as timeline spans: what the train benchmark's timeline and the kernel
benchmarks' per-kernel tables are read from.

:func:`profile_steps` runs a step callable a few times under ``torch.profiler`` (CUDA
activity where the device is CUDA), each call labelled as a ``recaccel-bench`` step, and
reads the trace into :class:`~recaccel.plotting.timeline.Timeline` spans.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from recaccel.plotting.timeline import STEP, Timeline, spans_from_trace


def profile_steps(
    step: Callable[[], object], steps: int, device: torch.device, host_table: Path | None = None
) -> Timeline:
    """Spans of ``steps`` calls of ``step`` (the caller warms it up first).

    Args:
        step: One step; its work is labelled ``recaccel-bench/step``.
        steps: Profiled calls.
        device: Where the work runs (CUDA adds the streams' kernels; the device is
            synchronised before and after, so the spans hold whole steps).
        host_table: Where to write the profiler's table of host ops by self CPU time (the
            30 largest), or None.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # Shapes recorded: each kernel of the tables is named with its launching op's inputs.
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            with record_function(STEP):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if host_table is not None:
        host_table.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    with tempfile.TemporaryDirectory(prefix="recaccel-profile-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return spans_from_trace(json.loads(path.read_text()))
