"""A benchmark's outputs: ``--out`` / ``--plot`` options and the markdown report."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

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
