"""Which Python functions a step's host time goes to: a ``cProfile`` table per iteration.

``torch.profiler`` times the ops a step launches; what runs between them (the trainer's
loop, the pipeline, autograd Functions, Triton's launcher, config and tuning lookups) lands
in the enclosing label's "self CPU" as one number: on the H200 (session 15) 4.2 ms a step
of ``bench_criteo_1hot`` and 5.8 ms of ``bench_wide`` sat there, beside steps of 6.3 and
6.7 ms. :func:`python_hotspots` runs a step a few more times under ``cProfile`` and lists
the functions by their own time per iteration, C entry points (torch ops, launches,
synchronisations) included, so that cost has names. cProfile's per-call overhead inflates
the figures of call-heavy Python (about 1.5-2x); the ranking is what it is for.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable

ROWS = 40  # functions listed

_FileLineName = tuple[str, int, str]


def python_hotspots(step: Callable[[], object], iterations: int, rows: int = ROWS) -> list[str]:
    """Runs ``step`` ``iterations`` times under ``cProfile`` (the caller warms it up first);
    returns a text table of the ``rows`` functions with the most own time.

    Each row: own ms, cumulative ms and calls, per iteration, then the function. A second
    profiler already active (``cProfile`` refuses to nest) gives one line saying so.

    Args:
        step: One iteration.
        iterations: Profiled calls (>= 1).
        rows: Functions listed.
    """
    if iterations < 1:
        raise ValueError(f"python_hotspots: iterations must be >= 1, got {iterations}")
    profiler = cProfile.Profile()
    try:
        profiler.enable()
    except ValueError as e:  # another profiler holds the interpreter's hook
        return [f"no Python profile: {e}"]
    start = time.perf_counter()
    try:
        for _ in range(iterations):
            step()
    finally:
        profiler.disable()
    wall_ms = 1e3 * (time.perf_counter() - start) / iterations
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (prim calls, calls, own s, cum s, callers)
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:rows]
    per = 1e3 / iterations
    lines = [
        f"Python functions by own time, per iteration (cProfile, {iterations} iterations, "
        f"{wall_ms:.3f} ms wall per iteration under it)",
        "",
        f"{'own ms':>9} {'cum ms':>9} {'calls':>8}  function",
    ]
    lines += [
        f"{own * per:9.3f} {cum * per:9.3f} {calls / iterations:8.1f}  {function_label(key)}"
        for key, (_, calls, own, cum, _) in ranked
    ]
    return lines


def function_label(key: _FileLineName) -> str:
    """``path:line(name)`` with the path from its package on (``recaccel/...``, ``torch/...``),
    or the builtin's name (``<method 'sort' of 'torch._C.TensorBase' objects>``)."""
    path, line, name = key
    if path == "~" and line == 0:
        return name
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        if "/recaccel/" in path:
            path = "recaccel/" + path.rsplit("/recaccel/", 1)[1]
    return f"{path}:{line}({name})"
