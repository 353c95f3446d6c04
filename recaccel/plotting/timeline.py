"""A timeline picture of a profiled training loop: a ``torch.profiler`` Chrome trace read
into :class:`Span` s (:func:`spans_from_trace`): on CPU threads the ``recaccel-bench/``
labelled phases and autograd's backward nodes; on CUDA streams every kernel, copy and
fill, coloured by the phase whose host code launched it (the launch's correlation id).
:func:`plot_timeline` draws them as a Gantt chart, one row per thread or stream.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recaccel.plotting import pyplot, save_figure

PREFIX = "recaccel-bench/"
STEP = PREFIX + "step"
DATA, PREPARE, LOOKUP = "data / copy", "prepare", "embedding lookup"
FORWARD, BACKWARD, SPARSE, OPTIMIZER, OTHER = (
    "dense forward",
    "dense backward",
    "sparse update",
    "optimizer",
    "other",
)
KINDS = (DATA, PREPARE, LOOKUP, FORWARD, BACKWARD, SPARSE, OPTIMIZER, OTHER)
COLORS = dict(
    zip(KINDS, ("#8c564b", "#9467bd", "#1f77b4", "#2ca02c", "#98df8a", "#d62728", "#ff7f0e", "#c7c7c7"))
)
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# Backward nodes of embedding lookups: their backward is the (fused) sparse update.
SPARSE_NODES = ("Embedding", "Lookup", "Fused", "lookup")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Span:
    """One bar of the timeline.

    Attributes:
        row: ``CPU thread <tid>`` (``main`` / ``autograd`` where known) or ``CUDA stream <id>``.
        kind: one of :data:`KINDS`.
        name: the op, kernel or phase.
        start_ms: from the first profiled step's start.
        end_ms: likewise.
    """

    row: str
    kind: str
    name: str
    start_ms: float
    end_ms: float


@dataclass
class Timeline:
    """The spans of the profiled steps and where each step began (ms)."""

    spans: list[Span]
    step_starts: list[float]


def _kind_of_label(name: str) -> str | None:
    return name.removeprefix(PREFIX) if name.startswith(PREFIX) and name != STEP else None


def _kind_of_node(name: str) -> str:
    node = name.removeprefix(BACKWARD_NODE)
    return SPARSE if any(s in node for s in SPARSE_NODES) else BACKWARD


class _Phases:
    """Labelled phases of each CPU thread, to find the innermost one around a launch."""

    def __init__(self) -> None:
        self.by_tid: dict[Any, list[tuple[float, float, str]]] = {}

    def add(self, tid: Any, start: float, end: float, kind: str) -> None:
        self.by_tid.setdefault(tid, []).append((start, end, kind))

    def finish(self) -> None:
        for spans in self.by_tid.values():
            spans.sort()

    def at(self, tid: Any, ts: float) -> str:
        """The kind of the shortest phase of thread ``tid`` holding time ``ts``."""
        spans = self.by_tid.get(tid, [])
        best = None
        for start, end, kind in spans[: bisect.bisect_right(spans, (ts, float("inf"), ""))]:
            if start <= ts <= end and (best is None or end - start < best[0]):
                best = (end - start, kind)
        return best[1] if best else OTHER


def spans_from_trace(trace: dict) -> Timeline:
    """The timeline of a Chrome trace written by ``torch.profiler`` (``traceEvents``).

    CPU rows: the ``recaccel-bench/`` labels and autograd's backward nodes (embedding
    nodes are the fused sparse update), on the thread that ran them. CUDA rows: every
    kernel, copy and fill on its stream, of the kind of the phase around its launch on
    the host (a host-to-device copy is ``data / copy``).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    host = [e for e in events if not str(e.get("cat", "")).startswith("gpu_")]  # labels' GPU projections out
    steps = sorted(float(e["ts"]) for e in host if e.get("name") == STEP)
    origin = steps[0] if steps else min((float(e["ts"]) for e in events), default=0.0)
    main = {e.get("tid") for e in host if e.get("name") == STEP}
    phases, launches, spans = _Phases(), {}, []

    def ms(us: float) -> float:
        return (us - origin) / 1e3

    def cpu_row(tid: Any, backward: bool) -> str:
        role = " (main)" if tid in main else " (autograd)" if backward else ""
        return f"CPU thread {tid}{role}"

    for e in host:
        name, tid, cat = e.get("name", ""), e.get("tid"), e.get("cat", "")
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        kind = _kind_of_label(name)
        if kind is None and name.startswith(BACKWARD_NODE):
            kind = _kind_of_node(name)
        if kind is not None:
            phases.add(tid, start, end, kind)
            label = name.removeprefix(PREFIX).removeprefix(BACKWARD_NODE)
            spans.append(Span(cpu_row(tid, name.startswith(BACKWARD_NODE)), kind, label, ms(start), ms(end)))
        elif cat in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (tid, start)
    phases.finish()
    for e in events:
        if e.get("cat") not in DEVICE_CATEGORIES:
            continue
        args = e.get("args", {})
        name = e.get("name", "")
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if e["cat"] == "gpu_memcpy" and "HtoD" in name:
            kind = DATA
        else:
            launch = launches.get(args.get("correlation"))
            kind = phases.at(*launch) if launch else OTHER
        spans.append(Span(f"CUDA stream {args.get('stream', '?')}", kind, name, ms(start), ms(end)))
    return Timeline(spans, [ms(s) for s in steps])


def kernel_table(timeline: Timeline, top: int = 30) -> list[dict]:
    """The CUDA work of the profiled steps by kernel name, largest total first: per step,
    its launches and device ms, its phase (the kind most of its time ran under) and its
    share of all device time. Overlapping streams make the shares sum past the step time.

    Args:
        timeline: From :func:`spans_from_trace`.
        top: Rows kept.

    Returns:
        ``[{"kernel", "phase", "launches_per_step", "ms_per_step", "share"}]``.
    """
    steps = max(1, len(timeline.step_starts))
    totals: dict[str, dict] = {}
    for s in timeline.spans:
        if not s.row.startswith("CUDA"):
            continue
        entry = totals.setdefault(s.name, {"ms": 0.0, "launches": 0, "by_kind": {}})
        ms = max(0.0, s.end_ms - s.start_ms)
        entry["ms"] += ms
        entry["launches"] += 1
        entry["by_kind"][s.kind] = entry["by_kind"].get(s.kind, 0.0) + ms
    device_ms = sum(e["ms"] for e in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: (-item[1]["ms"], item[0]))[:top]
    return [
        {
            "kernel": name if len(name) <= 90 else name[:87] + "...",
            "phase": max(e["by_kind"], key=e["by_kind"].get),
            "launches_per_step": round(e["launches"] / steps, 2),
            "ms_per_step": round(e["ms"] / steps, 4),
            "share": round(e["ms"] / device_ms, 4),
        }
        for name, e in ranked
    ]


def plot_timeline(timeline: Timeline, path: str | Path, title: str) -> Path:
    """A Gantt chart of ``timeline``: one row per CPU thread, then per CUDA stream; bars
    coloured by kind; dashed lines where each profiled step began."""
    plt = pyplot()
    rows = sorted({s.row for s in timeline.spans}, key=lambda r: (r.startswith("CUDA"), "(main)" not in r, r))
    fig, ax = plt.subplots(figsize=(13.0, 2.0 + 0.55 * max(len(rows), 1)))
    for y, row in enumerate(rows):
        for kind in KINDS:
            bars = [
                (s.start_ms, max(s.end_ms - s.start_ms, 1e-4))
                for s in timeline.spans
                if s.row == row and s.kind == kind
            ]
            if bars:
                ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=COLORS[kind], linewidth=0)
    for k, start in enumerate(timeline.step_starts):
        ax.axvline(start, color="black", linestyle="--", linewidth=0.8)
        ax.text(start, len(rows) - 0.4, f" step {k + 1}", fontsize=7, va="bottom")
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first profiled step began")
    ax.set_title(title, fontsize=9)
    used = [k for k in KINDS if any(s.kind == k for s in timeline.spans)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in used]
    fig.legend(handles, used, fontsize=7, loc="lower center", ncol=max(len(used), 1))
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return save_figure(fig, path, dpi=130)
