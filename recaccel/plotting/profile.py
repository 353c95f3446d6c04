"""The timeline picture of a training run's profile (``train.profile_steps``): the trace
the trainer wrote, drawn like ``recaccel-bench train``'s timelines."""

from __future__ import annotations

import json
from pathlib import Path

from recaccel.plotting.timeline import STEP, plot_timeline, spans_from_trace
from recaccel.train.run.profiling import STEP_LABEL


def draw_profile(trace: str | Path, png: str | Path | None = None) -> Path:
    """Draws the Chrome trace ``trace`` as a per-thread, per-stream timeline.

    Args:
        trace: a ``profile-steps-<first>-<last>.json`` of a run.
        png: the picture (default: the trace's path with ``.png``).

    Returns:
        The written picture.
    """
    trace = Path(trace)
    events = json.loads(trace.read_text())
    for event in events.get("traceEvents", []):
        if event.get("name") == STEP_LABEL:  # the plotter marks where each step began
            event["name"] = STEP
    title = f"{trace.parent.name}: {trace.stem}"
    return plot_timeline(spans_from_trace(events), png or trace.with_suffix(".png"), title)
