"""Shared benchmark helpers: interleaved timing, environment capture, markdown reports.

Timing follows DESIGN.md's rules: candidates are timed in the same process and run,
interleaved within every repeat (their order rotating from repeat to repeat, so drift
and warm-cache position effects hit all alike), and summarised by the median. On CUDA
each call is bracketed by CUDA events and the device synchronised before reading them;
on CPU ``time.perf_counter`` brackets each call.
"""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

RESULTS_DIR = Path("runs/bench")
"""Where a benchmark writes unless told otherwise (relative to the working directory, like
``train.out_dir``). The tracked ``bench/results/`` is written only when named, e.g.
``--out bench/results/embedding.md``."""


def add_output_args(parser, name: str, plot: str | None = None) -> None:
    """Adds ``--out`` (the markdown summary) and, when ``plot`` describes one, ``--plot``.

    Args:
        parser: the benchmark's ``argparse`` parser.
        name: the benchmark's name; the summary defaults to ``runs/bench/<name>.md``.
        plot: what the PNG shows (its help text), or None for a benchmark without a plot.
    """
    parser.add_argument(
        "--out",
        default=str(RESULTS_DIR / f"{name}.md"),
        help=f"markdown summary (default %(default)s; bench/results/{name}.md updates the published one)",
    )
    if plot is not None:
        parser.add_argument("--plot", help=f"PNG of {plot} (default: next to --out, as .png; '' = none)")


def plot_file(args) -> Path | None:
    """The PNG a benchmark run writes: ``--plot``, else ``--out`` with ``.png``; None for ``--plot ''``."""
    if args.plot == "":
        return None
    return Path(args.plot) if args.plot is not None else Path(args.out).with_suffix(".png")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved_samples(
    candidates: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device | str,
) -> dict[str, list[float]]:
    """Times each candidate ``repeats`` times, interleaved; returns every sample in ms.

    Args:
        candidates: name -> zero-argument callable doing one unit of work.
        repeats: Timed calls per candidate (>= 1).
        warmup: Untimed calls per candidate first (compilation, caches, allocator).
        device: Where the work runs; CUDA is timed with events.

    Returns:
        name -> ``repeats`` durations in milliseconds, in call order.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    if device.type == "cuda":
        events = {name: [] for name in names}
        for r in range(repeats):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                candidates[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize(device)
        for name in names:
            samples[name] = [s.elapsed_time(e) for s, e in events[name]]
        return samples
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            t0 = time.perf_counter()
            candidates[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return samples


def time_interleaved(
    candidates: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device | str,
) -> dict[str, float]:
    """Median milliseconds per candidate, timed interleaved (see :func:`time_interleaved_samples`)."""
    samples = time_interleaved_samples(candidates, repeats, warmup, device)
    return {name: statistics.median(s) for name, s in samples.items()}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], check=False, capture_output=True, text=True, timeout=5, cwd=PROJECT_ROOT
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# The checkout holding the recaccel package (recaccel/ sits in it).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _git_commit() -> str:
    """The project's own commit, or ``"unknown"``: a tree copied without its ``.git`` into
    another repository must not report that repository's commit."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != PROJECT_ROOT:
        return "unknown"
    return _git("rev-parse", "--short", "HEAD") or "unknown"


def environment_info(device: torch.device | str) -> dict:
    """What a result depends on: device, library versions, date (UTC), git commit."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": _git_commit(),
    }


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[Mapping]) -> str:
    """A GitHub markdown table; columns are the union of the rows' keys, in first-seen order."""
    if not rows:
        return "(no results)\n"
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results_markdown(
    path: str | Path,
    title: str,
    env: Mapping,
    command: str,
    table_rows: Sequence[Mapping],
    notes: str | Sequence[str] = (),
) -> Path:
    """Writes a benchmark report: title, environment, exact command, results table, notes.

    Args:
        path: Output ``.md`` file (parent folders are created).
        title: First heading.
        env: From :func:`environment_info`.
        command: The exact command line that produced the results.
        table_rows: One mapping per result row.
        notes: Free text (one string, or one bullet per item).

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}\n"]
    parts += [f"- {key}: {_cell(value)}" for key, value in env.items()]
    parts += ["", "Command:", "", "```", command, "```", "", markdown_table(table_rows)]
    if isinstance(notes, str):
        notes = [notes] if notes else []
    if notes:
        parts += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    path.write_text("\n".join(parts))
    return path


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (plots are written to files,
    often on machines without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int) -> Path:
    """Saves a matplotlib figure as a PNG (parent folders created) and closes it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def measure_copy_bandwidth(
    device: torch.device | str, nbytes: int | None = None, repeats: int = 20, warmup: int = 3
) -> float:
    """Achievable memory bandwidth in GB/s, counting bytes read plus bytes written.

    A device-to-device copy of a large buffer on CUDA (default 1 GiB), a memcpy of a
    large tensor on CPU (default 128 MiB); random contents, median of ``repeats``.

    Args:
        device: Where to measure.
        nbytes: Buffer size in bytes.
        repeats: Timed copies.
        warmup: Untimed copies first.

    Returns:
        GB/s (1e9 bytes per second).
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 2**27
    n = nbytes // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    ms = time_interleaved({"copy": lambda: dst.copy_(src)}, repeats, warmup, device)["copy"]
    return 2 * n * 4 / (ms * 1e-3) / 1e9
