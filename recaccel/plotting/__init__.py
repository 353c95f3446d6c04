"""matplotlib helpers shared by the plotting commands and the benchmarks: figures are
written to files, often on machines without a display."""

from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save_figure"]


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
