"""recaccel-monitor: a hybrid run's per-rank step and collective times (the ``monitor``
events of its log.jsonl, written with ``monitor.every > 0``): a table and a PNG."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recaccel.cli.common import run_command, setup_logging
from recaccel.errors import ConfigError
from recaccel.plotting import pyplot, save_figure

DEFAULT_PNG = "monitor.png"
# Table columns: (event field, heading, scale to the shown unit).
_COLUMNS = (
    ("step_s", "step ms", 1e3),
    ("compute_s", "compute ms", 1e3),
    ("comm_s", "comm ms", 1e3),
    ("agree_s", "agree ms", 1e3),
    ("lookup_s", "lookup ms", 1e3),
    ("dense_sync_s", "dense_sync ms", 1e3),
    ("bytes", "KiB/step", 1 / 1024),
)


def monitor_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="recaccel-monitor",
        description="Per-rank step, compute and collective times of a hybrid run (monitor.every > 0) "
        "from RUN_DIR/log.jsonl: a table, and a PNG of per-rank step compute times.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory (train.out_dir)")
    parser.add_argument("--out", type=Path, help=f"the PNG to write (default RUN_DIR/{DEFAULT_PNG})")
    args = parser.parse_args(argv)
    setup_logging(False)

    def body() -> int:
        from recaccel.train.run.runlog import read_events

        events = monitor_events(read_events(args.run_dir), str(args.run_dir))
        print(rank_table(events))
        out = args.out if args.out is not None else args.run_dir / DEFAULT_PNG
        print(f"per-rank step times written to {plot_ranks(events, out, title=str(args.run_dir))}")
        return 0

    return run_command("recaccel-monitor", body)


def monitor_events(events: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The ``monitor`` events of a run (a resumed stretch replaces later steps' events).

    Raises:
        ConfigError: the log has none (the run had ``monitor.every = 0``).
    """
    kept: list[dict[str, Any]] = []
    for e in events:
        if e.get("event") == "monitor" and isinstance(e.get("step"), int):
            while kept and kept[-1]["step"] >= e["step"]:
                kept.pop()
            kept.append(e)
    if not kept:
        raise ConfigError(f"{where}: log.jsonl has no monitor event (train with monitor.every > 0)")
    return kept


def rank_table(events: list[dict[str, Any]]) -> str:
    """Per rank: the median over gathers of each timing, and the flags raised on it."""
    ranks = sorted({r for e in events for r in e["ranks"]}, key=int)
    flags: dict[str, list[str]] = {}
    for e in events:
        for f in e.get("flags", []):
            kind = (
                f"link to {f['peer']}" if f["kind"] == "link" else f["kind"]
            )  # a slow pair, on its lower rank
            seen = flags.setdefault(str(f["rank"]), [])
            if not any(n.startswith(kind) for n in seen):
                seen.append(f"{kind} from step {e['step']}")
    header = ["rank", *(h for _, h, _ in _COLUMNS), "flagged"]
    rows = []
    for r in ranks:
        values = [e["ranks"][r] for e in events if r in e["ranks"]]
        cells = [f"{statistics.median(v[key] for v in values) * scale:.2f}" for key, _, scale in _COLUMNS]
        rows.append([r, *cells, "; ".join(flags.get(r, [])) or "-"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    return "\n".join([*lines, f"({len(events)} gathers, medians over them)"])


def plot_ranks(events: list[dict[str, Any]], out: Path, *, title: str = "") -> Path:
    """Draws each rank's compute and collective time per gather (step on x) into ``out``.

    Raises:
        ConfigError: matplotlib is missing.
    """
    try:
        plt = pyplot()
    except ImportError as e:
        raise ConfigError(f"recaccel-monitor needs matplotlib (pip install matplotlib): {e}") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    ranks = sorted({r for e in events for r in e["ranks"]}, key=int)
    for ax, (key, label) in zip(axes, (("compute_s", "step compute ms"), ("comm_s", "collectives ms"))):
        for r in ranks:
            points = [(e["step"], e["ranks"][r][key] * 1e3) for e in events if r in e["ranks"]]
            ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=f"rank {r}")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for e in events:
        if e.get("flags"):  # a gather that flagged a rank
            axes[0].axvline(e["step"], color="tab:red", alpha=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out, dpi=100)
