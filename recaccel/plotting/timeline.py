"""A timeline picture of a profiled training loop: a ``torch.profiler`` Chrome trace read
into :class:`Span` s (:func:`spans_from_trace`): on CPU threads the ``recaccel-bench/``
labelled phases and autograd's backward nodes; on CUDA streams every kernel, copy and
fill, coloured by the phase whose host code launched it (the launch's correlation id)
and named with the op that launched it (its input shapes and dtypes when the profiler
recorded shapes). :func:`plot_timeline` draws them as a Gantt chart, one row per thread or
stream; :func:`kernel_table` sums the device time per kernel.
"""

from __future__ import annotations

import bisect
import re
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
        op: for CUDA work, the host op that launched it (:func:`op_label`), or ``""``.
    """

    row: str
    kind: str
    name: str
    start_ms: float
    end_ms: float
    op: str = ""


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


# Input dtypes as the profiler names them, shortened for the tables.
_DTYPES = {"float": "f32", "c10::BFloat16": "bf16", "c10::Half": "f16", "double": "f64", "long int": "i64",
           "int": "i32", "bool": "bool", "unsigned char": "u8", "signed char": "i8", "short int": "i16"}  # fmt: skip
_OP_INPUTS = 3  # tensor inputs shown per op


def op_label(event: dict) -> str:
    """A host op as the kernel tables name its launches: ``aten::copy_ [4096, 500, 32] bf16,
    [4096, 500, 32] f32`` (its first tensor inputs' shapes and dtypes where the profiler
    recorded shapes, else its name alone)."""
    args = event.get("args", {})
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    tensors = [
        f"{list(d)} {_DTYPES.get(t, t)}".strip()
        for d, t in zip(dims, list(types) + [""] * len(dims))
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d)
    ]
    name = str(event.get("name", ""))
    return f"{name} {', '.join(tensors[:_OP_INPUTS])}" if tensors else name


def short_kernel_name(name: str) -> str:
    """``name`` without the namespaces and qualifiers that fill the first 90 characters of
    a C++ kernel's name (``void at::native::(anonymous namespace)::``), so what tells two
    kernels apart (the functor, the dtype) stays in a table's column. A namespace goes only
    where it begins a qualified name (``cuda::std::tuple`` keeps its ``std::``)."""
    name, shorter = "", name.removeprefix("void ")
    while shorter != name:  # again: a namespace may begin where the one removed ended
        name, shorter = shorter, _NOISE.sub("", shorter)
    return name


# Leading namespaces of PyTorch's and CUB's kernels, each removed where no name or scope
# operator precedes it.
_NOISE = re.compile(
    r"(?<![\w:])(?:at::native::|at::cuda::|at::|c10::|std::|at_cuda_detail::cub::detail::|\(anonymous namespace\)::)"
)


def spans_from_trace(trace: dict) -> Timeline:
    """The timeline of a Chrome trace written by ``torch.profiler`` (``traceEvents``).

    CPU rows: the ``recaccel-bench/`` labels and autograd's backward nodes (embedding
    nodes are the fused sparse update), on the thread that ran them. CUDA rows: every
    kernel, copy and fill on its stream, of the kind of the phase around its launch on
    the host (a host-to-device copy is ``data / copy``), with the op that launched it
    (the innermost host op around the launch, by the profiler's ``External id``).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    host = [e for e in events if not str(e.get("cat", "")).startswith("gpu_")]  # labels' GPU projections out
    steps = sorted(float(e["ts"]) for e in host if e.get("name") == STEP)
    origin = steps[0] if steps else min((float(e["ts"]) for e in events), default=0.0)
    main = {e.get("tid") for e in host if e.get("name") == STEP}
    phases, launches, spans = _Phases(), {}, []
    ops = {
        e["args"]["External id"]: op_label(e)
        for e in host
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }

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
            launches[e["args"]["correlation"]] = (tid, start, e["args"].get("External id"))
    phases.finish()
    for e in events:
        if e.get("cat") not in DEVICE_CATEGORIES:
            continue
        args = e.get("args", {})
        name = e.get("name", "")
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        launch = launches.get(args.get("correlation"))
        if e["cat"] == "gpu_memcpy" and "HtoD" in name:
            kind = DATA
        else:
            kind = phases.at(*launch[:2]) if launch else OTHER
        external = args.get("External id", launch[2] if launch else None)
        op = ops.get(external, "")
        spans.append(Span(f"CUDA stream {args.get('stream', '?')}", kind, name, ms(start), ms(end), op))
    return Timeline(spans, [ms(s) for s in steps])


def kernel_table(timeline: Timeline, top: int = 30) -> list[dict]:
    """The CUDA work of the profiled steps by kernel name, largest total first: per step,
    its launches and device ms, its phase (the kind most of its time ran under) and its
    share of all device time, and the host op that launched most of it (``launched_by``:
    ``aten::copy_ [4096, 500, 32] bf16, ...``, with its share of the kernel's time when
    other ops launched the rest). Overlapping streams make the shares sum past the step
    time.

    Args:
        timeline: From :func:`spans_from_trace`.
        top: Rows kept.

    Returns:
        ``[{"kernel", "phase", "launches_per_step", "ms_per_step", "share", "launched_by"}]``.
    """
    steps = max(1, len(timeline.step_starts))
    totals: dict[str, dict] = {}
    for s in timeline.spans:
        if not s.row.startswith("CUDA"):
            continue
        entry = totals.setdefault(s.name, {"ms": 0.0, "launches": 0, "by_kind": {}, "by_op": {}})
        ms = max(0.0, s.end_ms - s.start_ms)
        entry["ms"] += ms
        entry["launches"] += 1
        entry["by_kind"][s.kind] = entry["by_kind"].get(s.kind, 0.0) + ms
        entry["by_op"][s.op] = entry["by_op"].get(s.op, 0.0) + ms
    device_ms = sum(e["ms"] for e in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: (-item[1]["ms"], item[0]))[:top]
    return [
        {
            "kernel": _clip(short_kernel_name(name), 90),
            "phase": max(e["by_kind"], key=e["by_kind"].get),
            "launches_per_step": round(e["launches"] / steps, 2),
            "ms_per_step": round(e["ms"] / steps, 4),
            "share": round(e["ms"] / device_ms, 4),
            "launched_by": _main_op(e["by_op"], e["ms"]),
        }
        for name, e in ranked
    ]


def launched_by_cell(text: str) -> str:
    """A kernel table's "launched by" cell: the op as code, ``-`` when none is known."""
    return f"`{text}`" if text else "-"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _main_op(by_op: dict[str, float], total_ms: float) -> str:
    """The op that launched most of a kernel's time, with its share when not all of it."""
    op, ms = max(by_op.items(), key=lambda item: (item[1], item[0]))
    if not op:
        return ""
    share = ms / total_ms if total_ms > 0 else 1.0
    return _clip(op, 110) + ("" if share > 0.995 else f" ({share:.0%})")


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
