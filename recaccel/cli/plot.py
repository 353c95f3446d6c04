"""recaccel-plot: a PNG of a run's curves from its log.jsonl (train loss, evaluation
metrics, learning rates, samples/s)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recaccel.cli.common import run_command, setup_logging
from recaccel.errors import ConfigError
from recaccel.plotting import pyplot, save_figure

DEFAULT_PNG = "curves.png"
# Evaluation fields that are sizes or constants of the data, not a quality to follow.
_NOT_CURVES = frozenset({"time", "eval_rows", "ctr", "steps", "epochs", "train_samples"})


def plot_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="recaccel-plot",
        description="Plot a run's curves (train loss, eval metrics, learning rates, samples/s) from RUN_DIR/log.jsonl.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory (train.out_dir)")
    parser.add_argument("--out", type=Path, help=f"the PNG to write (default RUN_DIR/{DEFAULT_PNG})")
    args = parser.parse_args(argv)
    setup_logging(False)

    def body() -> int:
        from recaccel.train.run.runlog import read_events

        out = args.out if args.out is not None else args.run_dir / DEFAULT_PNG
        path = plot_run(curves(read_events(args.run_dir)), out, title=str(args.run_dir))
        print(f"curves written to {path}")
        return 0

    return run_command("recaccel-plot", body)


def curves(events: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The (step, value) series of a run's events, per panel and name.

    Panels: ``loss`` (train loss), ``eval`` (each float an eval event holds, and the
    final event's at its step), ``lr`` (``lr``, ``sparse_lr``), ``throughput``
    (``samples_per_s``). A resumed run's later stretch replaces what the earlier one
    logged at the same or later steps (it trained them again from a checkpoint).
    """
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {
        "loss": {},
        "eval": {},
        "lr": {},
        "throughput": {},
    }
    for e in events:
        kind = e.get("event")
        if kind == "train":
            picked = {"loss": {"train loss": e.get("loss")}, "lr": {k: e.get(k) for k in ("lr", "sparse_lr")}}
            picked["throughput"] = {"samples/s": e.get("samples_per_s")}
            step = e.get("step")
        elif kind in ("eval", "final"):
            values = {k: v for k, v in e.items() if isinstance(v, float) and k not in _NOT_CURVES}
            values = {
                k: v
                for k, v in values.items()
                if not k.endswith(("_s", "_fraction", "_loss")) and not k.startswith("cache_")
            }
            picked, step = {"eval": values}, e.get("step", e.get("steps"))
        else:
            continue
        if not isinstance(step, int):
            continue
        for panel, values in picked.items():
            for name, value in values.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    _add(panels[panel].setdefault(name, []), step, float(value))
    return panels


def _add(series: list[tuple[int, float]], step: int, value: float) -> None:
    """Appends, first dropping points at ``step`` or later (a resumed stretch)."""
    while series and series[-1][0] >= step:
        series.pop()
    series.append((step, value))


def plot_run(panels: dict[str, dict[str, list[tuple[int, float]]]], out: Path, *, title: str = "") -> Path:
    """Draws the panels of :func:`curves` (2 x 2) into the PNG ``out``.

    Raises:
        ConfigError: matplotlib is missing, or the log has no curve at all.
    """
    if not any(panels.values()):
        raise ConfigError(f"{title}: log.jsonl has no train or eval event to plot")
    try:
        plt = pyplot()
    except ImportError as e:
        raise ConfigError(f"recaccel-plot needs matplotlib (pip install matplotlib): {e}") from None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    labels = {
        "loss": "train loss",
        "eval": "evaluation",
        "lr": "learning rate (dense left, sparse right)",
        "throughput": "samples/s",
    }
    for ax, (panel, series) in zip(axes.flat, panels.items()):
        ax.set_title(labels[panel])
        ax.grid(alpha=0.3)
        if panel == "lr":
            _rates(ax, series)
            continue
        for name, points in series.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="." if len(points) < 30 else None, label=name)
        if len(series) > 1:
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out, dpi=100)


def _rates(ax, series: dict[str, list[tuple[int, float]]]) -> None:
    """Dense rate on the left axis, sparse on a right one (their scales differ)."""
    if "lr" in series:
        steps, values = zip(*series["lr"])
        ax.plot(steps, values, color="tab:blue", label="lr (dense)")
        ax.set_ylabel("lr", color="tab:blue")
    if "sparse_lr" in series:
        right = ax.twinx()
        steps, values = zip(*series["sparse_lr"])
        right.plot(steps, values, color="tab:orange", linestyle="--", label="sparse_lr")
        right.set_ylabel("sparse_lr", color="tab:orange")
