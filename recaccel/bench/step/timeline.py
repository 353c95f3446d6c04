"""The timeline picture of ``recaccel-bench train``: what a few pipelined steps of the
trainer's loop do, per CPU thread and per CUDA stream.

:func:`record_timeline` runs the loop of a ``recaccel`` candidate
(:class:`~recaccel.bench.step.parts.TrainerParts`) under ``torch.profiler`` with its
pieces labelled (the objective's ``prepare``, ``embed``, head and loss, the embedding's
micro-batch lookup and deferred update, the dense optimizer, the loader's next batch;
the labels are removed afterwards); :mod:`recaccel.plotting.timeline` reads the
profiler's Chrome trace and draws it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from recaccel.bench.harness.profiling import profile_steps
from recaccel.bench.harness.python_profile import python_hotspots
from recaccel.bench.step.candidates import Candidate
from recaccel.bench.step.data import Preset, ReaderBatches, RotatingBatches
from recaccel.bench.step.parts import TrainerParts
from recaccel.plotting.timeline import (
    DATA,
    FORWARD,
    LOOKUP,
    OPTIMIZER,
    PREFIX,
    PREPARE,
    SPARSE,
    Timeline,
    kernel_table,
    launched_by_cell,
    plot_timeline,
)


class _Labelled:
    """``fn`` called under a ``record_function`` label; its other attributes read through, so
    code that asks the wrapped piece for more (the graphed head's ``pooled_buffer``) takes the
    same path as in an unlabelled step (a plain wrapper made the profiled step copy the
    pooled rows in and their gradient out: ~0.4 ms on the H200 the timed step never spent)."""

    def __init__(self, label: str, fn: Callable) -> None:
        self._label, self._fn = label, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(PREFIX + self._label):
            return self._fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_fn", "_label"):  # copy / pickle probe these first
            raise AttributeError(name)
        return getattr(self._fn, name)


def _labelled(label: str, fn: Callable) -> Callable:
    return _Labelled(label, fn)


@contextlib.contextmanager
def labelled_phases(parts: TrainerParts) -> Iterator[None]:
    """Wraps the loop's pieces in ``record_function`` labels (instance attributes), and
    restores them on exit."""
    objective, optimizer = parts.objective, parts.optimizer
    embedding = objective.embedding
    targets = [
        (objective, "prepare", PREPARE),
        (objective, "embed", LOOKUP),
        (objective, "_head", FORWARD),
        (objective, "_loss", FORWARD),
        (optimizer, "step", OPTIMIZER),
        (optimizer, "zero_grad", OPTIMIZER),
    ]
    targets += [(embedding, a, k) for a, k in (("lookup_rows", LOOKUP), ("apply_gradient", SPARSE))]
    saved = []
    for obj, attr, label in targets:
        if getattr(obj, attr, None) is None:
            continue
        saved.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
        setattr(obj, attr, _labelled(label, getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_MISSING = object()


def _labelled_pairs(pairs: Iterator) -> Iterator:
    while True:
        with record_function(PREFIX + DATA):
            pair = next(pairs, None)
        if pair is None:
            return
        yield pair


def record_timeline(
    parts: TrainerParts,
    source,
    device: torch.device,
    steps: int,
    warmup: int = 2,
    host_table: Path | None = None,
    python_table: Path | None = None,
) -> Timeline:
    """Profiles ``steps`` steps of the trainer's loop on ``source``'s batches (after
    ``warmup`` unprofiled ones) and returns their spans.

    Args:
        parts: the candidate's objective, optimizer and loop.
        source: ``RotatingBatches`` or ``ReaderBatches`` (its ``pairs()``).
        device: where the loop runs (CUDA adds the streams' kernels).
        steps: profiled steps.
        warmup: steps run first, unprofiled.
        host_table: where to write the profiler's table of host ops by self CPU time (the
            30 largest): what the host spends a step on, launches included.
        python_table: where to write the Python functions by own time of ``steps`` more
            steps, run under ``cProfile`` (:func:`~recaccel.bench.harness.python_profile.python_hotspots`):
            what fills the host time between the ops.
    """
    with labelled_phases(parts):
        loop = parts.steps(_labelled_pairs(source.pairs()))
        for _ in range(warmup):
            next(loop)
        spans = profile_steps(loop.__next__, steps, device, host_table)
        if python_table is not None:
            python_table.write_text("\n".join(python_hotspots(loop.__next__, steps)) + "\n")
        del loop
    return spans


def draw_timeline(candidate: Candidate, preset: Preset, data: Path | list, steps: int, path: Path) -> str:
    """Profiles ``steps`` steps of ``candidate`` (through the reader when ``data`` is the
    dataset's folder, else on the device batches) and draws them at ``path``; returns the
    note naming the picture, or why there is none (a profiler failure does not end the
    benchmark)."""
    reader = isinstance(data, Path)
    where = "through the reader" if reader else "device data"
    label = candidate.combination.label
    title = f"{preset.name}: recaccel {label}, {where}"
    host_table, python_table = host_table_path(path), python_table_path(path)
    try:
        dev = next(candidate.trainer.model.parameters()).device
        source = ReaderBatches(data, preset, dev) if reader else RotatingBatches(data)
        try:
            spans = record_timeline(
                candidate.trainer, source, dev, steps, host_table=host_table, python_table=python_table
            )
        finally:
            source.close()
        kernels = write_kernel_table(spans, kernel_table_path(path), f"{title}, {dev}")
        plot_timeline(spans, path, f"{title}, {dev}")
    except Exception as e:  # the profiler (CUPTI) or matplotlib: the timed results stand without it
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{preset.name}: no timeline ({type(e).__name__}: {first})"[:300]
    return (
        f"{preset.name}: timeline of {steps} {label} steps ({where}): {path.name}, its kernels: {kernels.name}, "
        f"host ops: {host_table.name}, Python functions: {python_table.name}"
    )


def kernel_table_path(timeline_png: Path) -> Path:
    """Where the kernel table of a timeline picture goes: beside it, ``<stem>_kernels.md``."""
    return timeline_png.with_name(f"{timeline_png.stem}_kernels.md")


def host_table_path(timeline_png: Path) -> Path:
    """Where the host-op table of a timeline picture goes: beside it, ``<stem>_host.txt``."""
    return timeline_png.with_name(f"{timeline_png.stem}_host.txt")


def python_table_path(timeline_png: Path) -> Path:
    """Where the Python-function table of a timeline picture goes: beside it, ``<stem>_python.txt``."""
    return timeline_png.with_name(f"{timeline_png.stem}_python.txt")


def write_kernel_table(spans: Timeline, path: Path, title: str) -> Path:
    """The profiled steps' device time by kernel (:func:`~recaccel.plotting.timeline.kernel_table`)
    as a markdown table at ``path``, each kernel with the host op that launched it."""
    rows = kernel_table(spans)
    lines = [f"# Kernels per step: {title}", "",
             "| kernel | phase | launches / step | ms / step | share | launched by |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| `{r['kernel']}` | {r['phase']} | {r['launches_per_step']} | {r['ms_per_step']} | {r['share']:.1%} "
        f"| {launched_by_cell(r['launched_by'])} |"
        for r in rows
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
