"""Per-kernel device time of a kernel benchmark's candidates: what share of a forward +
backward is GEMM, elementwise, reductions.

:func:`profile_fwd_bwd` runs a few forward + backward iterations of one candidate under
``torch.profiler`` (CUDA activity), each iteration labelled as a step and its forward as the
dense forward, so :mod:`recaccel.plotting.timeline` reads the trace into spans and
:func:`~recaccel.plotting.timeline.kernel_table` sums them per kernel; here each kernel gets
a class (:func:`kernel_class`) and :func:`write_breakdown` writes the candidates' tables, with
a summary by class first, as markdown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.profiler import record_function

from recaccel.bench.harness.profiling import profile_steps
from recaccel.plotting.timeline import (
    BACKWARD,
    FORWARD,
    PREFIX,
    Timeline,
    kernel_table,
    launched_by_cell,
)

GEMM, ELEMENTWISE, REDUCTION, FUSED, COPY, OTHER = (
    "GEMM",
    "elementwise",
    "reduction",
    "fused cross",
    "copy / fill",
    "other",
)
CLASSES = (GEMM, ELEMENTWISE, REDUCTION, FUSED, COPY, OTHER)
# Lower-case name fragments of each class, tried in this order (cuBLAS's split-K reduce is GEMM).
_MARKERS = (
    (FUSED, ("_cross_fwd_kernel", "_cross_bwd_kernel")),
    (GEMM, ("gemm", "gemv", "cutlass", "cublas", "xmma", "nvjet", "wgmma", "matmul")),
    (ELEMENTWISE, ("_ew_kernel", "elementwise", "vectorized", "unrolled", "pointwise")),
    (REDUCTION, ("reduce", "reduction", "sum")),
    (COPY, ("memcpy", "memset", "copy", "fill")),
)
TOP_KERNELS = 25  # rows per candidate in the markdown (the summary counts every kernel)


def kernel_class(name: str) -> str:
    """The class of a kernel by its name: :data:`GEMM`, :data:`ELEMENTWISE`, ... or :data:`OTHER`."""
    lower = name.lower()
    for cls, markers in _MARKERS:
        if any(m in lower for m in markers):
            return cls
    return OTHER


def profile_fwd_bwd(
    fn: Callable[..., Tensor], inputs: Sequence[Tensor], grad: Tensor, device: torch.device, iterations: int
) -> Timeline:
    """Spans of ``iterations`` forward + backward calls of ``fn`` (after one unprofiled call).

    Args:
        fn: The candidate: tensors in, one tensor out.
        inputs: Its inputs; gradients are taken w.r.t. every one.
        grad: The output's gradient.
        device: Where it runs (CUDA for kernels to show).
        iterations: Profiled iterations, each a ``recaccel-bench/step``.
    """
    leaves = [t.detach().requires_grad_() for t in inputs]

    def once() -> None:
        with record_function(PREFIX + FORWARD):
            out = fn(*leaves)
        torch.autograd.grad(out, leaves, grad)

    once()
    return profile_steps(once, iterations, device)


def breakdown_rows(timeline: Timeline) -> list[dict]:
    """Every kernel of ``timeline`` (largest first) per iteration, with its class and the
    pass most of its time ran in (``forward``, ``backward``, or ``other``) and the host op
    that launched it:
    ``[{"kernel", "class", "pass", "launches_per_step", "ms_per_step", "share", "launched_by"}]``."""
    rows = kernel_table(timeline, top=len(timeline.spans) or 1)
    return [{"kernel": r["kernel"], "class": kernel_class(r["kernel"]), **_per_step(r)} for r in rows]


def _per_step(row: Mapping) -> dict:
    passes = {FORWARD: "forward", BACKWARD: "backward"}
    return {"pass": passes.get(row["phase"], "other")} | {
        k: row[k] for k in ("launches_per_step", "ms_per_step", "share", "launched_by")
    }


def class_totals(rows: Sequence[Mapping]) -> dict[str, dict]:
    """Device ms per iteration, launches and share of each class present in ``rows``, in :data:`CLASSES` order."""
    total = sum(r["ms_per_step"] for r in rows) or 1.0
    out: dict[str, dict] = {}
    for cls in CLASSES:
        mine = [r for r in rows if r["class"] == cls]
        if mine:
            ms = sum(r["ms_per_step"] for r in mine)
            launches = sum(r["launches_per_step"] for r in mine)
            out[cls] = {"ms_per_step": ms, "launches_per_step": launches, "share": ms / total}
    return out


def _summary_lines(tables: Mapping[str, Sequence[Mapping]], host_ms: Mapping[str, float]) -> list[str]:
    host = " host ms / iteration |" if host_ms else ""
    lines = [f"| candidate | device ms / iteration |{host} launches / iteration | by class (ms, share) |",
             "|---|---|---|---|" + ("---|" if host_ms else "")]  # fmt: skip
    for name, rows in tables.items():
        totals = class_totals(rows)
        by_class = "; ".join(f"{c} {t['ms_per_step']:.3f} ({t['share']:.1%})" for c, t in totals.items())
        ms = sum(r["ms_per_step"] for r in rows)
        launches = sum(r["launches_per_step"] for r in rows)
        host_cell = (f" {host_ms[name]:.3f} |" if name in host_ms else " - |") if host_ms else ""
        lines.append(f"| {name} | {ms:.3f} |{host_cell} {launches:g} | {by_class or '-'} |")
    return lines


def _candidate_lines(name: str, rows: Sequence[Mapping]) -> list[str]:
    lines = [f"## {name}", "",
             "| kernel | class | pass | launches / iteration | ms / iteration | share | launched by |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| `{r['kernel']}` | {r['class']} | {r['pass']} | {r['launches_per_step']:g} | {r['ms_per_step']:.4f} "
        f"| {r['share']:.1%} | {launched_by_cell(r.get('launched_by', ''))} |"
        for r in rows[:TOP_KERNELS]
    ]
    if len(rows) > TOP_KERNELS:
        lines.append(f"| ({len(rows) - TOP_KERNELS} more) | | | | | | |")
    return lines


def write_breakdown(
    tables: Mapping[str, Sequence[Mapping]],
    path: str | Path,
    title: str,
    iterations: int,
    host_ms: Mapping[str, float] | None = None,
) -> Path:
    """The candidates' kernel tables (from :func:`breakdown_rows`) as markdown at ``path``:
    a summary by class (with each candidate's host ms per iteration where ``host_ms`` has
    it), then one table per candidate (its :data:`TOP_KERNELS` largest kernels)."""
    lines = [f"# Kernels per iteration: {title}", ""]
    lines += [
        f"Device time of {iterations} profiled iterations per candidate (a forward + backward unless "
        "its name says otherwise; torch.profiler, CUDA activity), per iteration; share = of the "
        "candidate's device time; each kernel with the host op that launched most of its time.",
        *(
            [
                "Host ms / iteration: the host's time to issue an iteration, timed unprofiled; above the "
                "device ms, the host limits the candidate."
            ]
            if host_ms
            else []
        ),  # fmt: skip
        "",
        *_summary_lines(tables, host_ms or {}),
    ]
    for name, rows in tables.items():
        lines += ["", *_candidate_lines(name, rows)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def breakdown_path(markdown: str | Path) -> Path:
    """Where a benchmark's kernel tables go: beside its markdown, ``<stem>_kernels.md``."""
    markdown = Path(markdown)
    return markdown.with_name(f"{markdown.stem}_kernels.md")
