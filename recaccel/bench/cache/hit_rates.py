"""``recaccel-bench cache``: hit rate against cache size, lookahead vs LRU, LFU and Belady.

Each trace (:mod:`recaccel.bench.cache.traces`) is replayed through a cache of each
fraction of its table's rows (``int(fraction * rows)``, at least 1) under every policy of
:mod:`recaccel.bench.cache.policies`: ``lookahead`` for each k, ``lru``, ``lfu`` and
``belady``; the definitions of the policies, of a hit and of an infeasible cell are
there. This is a simulation on ids only (no embedding rows move), so its numbers do not
depend on the machine.

Outputs: the markdown summary (one table per trace: rows = cache fraction, columns =
policies), a plot (hit rate against cache fraction, one panel per trace, a line per
policy) and, with ``--json``, ``{"results": [{"trace", "cache_fraction", "lookahead",
"policy", "hit_rate"}, ...]}`` (``lookahead`` null for the other policies, ``hit_rate``
null for an infeasible cell) with the environment, the traces, the infeasible cells'
reasons and the skipped traces at the top level.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recaccel.bench.cache.policies import Outcome, Trace, simulate
from recaccel.bench.cache.traces import DEFAULT_TRACES, MissingData, TraceSizes, load_trace
from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, markdown_table, plot_file, write_results_markdown
from recaccel.errors import ConfigError
from recaccel.plotting import pyplot, save_figure

log = logging.getLogger(__name__)

DEFAULT_FRACTIONS = (0.01, 0.05, 0.1, 0.25)
DEFAULT_LOOKAHEAD = (1, 2, 4)


@dataclass(frozen=True)
class Cell:
    """One policy on one trace at one cache fraction."""

    trace: str
    cache_fraction: float
    lookahead: int | None  # k for ``lookahead``, None for the others
    policy: str
    outcome: Outcome

    def result(self) -> dict:
        """The JSON row: exactly the five keys the issue fixes."""
        return {
            "trace": self.trace,
            "cache_fraction": self.cache_fraction,
            "lookahead": self.lookahead,
            "policy": self.policy,
            "hit_rate": self.outcome.hit_rate,
        }

    @property
    def column(self) -> str:
        return f"lookahead k={self.lookahead}" if self.policy == "lookahead" else self.policy


def _list(text: str, kind: type, option: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(
            f"cache bench: {option} must be a comma-separated list of {kind.__name__}, got {text!r}"
        ) from None
    if not values:
        raise ConfigError(f"cache bench: {option} is empty")
    return values


def add_args(parser: argparse.ArgumentParser) -> None:
    """``recaccel-bench cache`` options."""
    parser.add_argument("--traces", default=",".join(DEFAULT_TRACES), help="comma-separated trace specs")
    parser.add_argument(
        "--fractions", default=",".join(map(str, DEFAULT_FRACTIONS)), help="cache sizes, share of rows"
    )
    parser.add_argument(
        "--lookahead", default=",".join(map(str, DEFAULT_LOOKAHEAD)), help="lookahead windows k"
    )
    sizes = TraceSizes()
    parser.add_argument("--zipf-rows", type=int, default=sizes.zipf_rows, help="rows of the Zipf table")
    parser.add_argument("--zipf-batch", type=int, default=sizes.zipf_batch, help="ids per Zipf batch")
    parser.add_argument("--zipf-batches", type=int, default=sizes.zipf_batches, help="Zipf batches")
    parser.add_argument(
        "--real-batch", type=int, default=sizes.real_batch, help="rows per batch of a real trace"
    )
    parser.add_argument("--seed", type=int, default=sizes.seed, help="seed of the Zipf draws")
    parser.add_argument(
        "--beyond",
        choices=("lru", "lfu"),
        default="lru",
        help="lookahead's victims among rows outside the window (default %(default)s)",
    )
    parser.add_argument(
        "--data", default="../shared/data", help="the real datasets' folder (default %(default)s)"
    )
    parser.add_argument("--json", help="also write the results here")
    add_output_args(parser, "cache", plot="hit rate against cache fraction")


def _fractions(text: str) -> list[float]:
    fractions = _list(text, float, "--fractions")
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad:
        raise ConfigError(f"cache bench: --fractions must lie in (0, 1], got {bad[0]}")
    return fractions


def _windows(text: str) -> list[int]:
    windows = _list(text, int, "--lookahead")
    if min(windows) < 1:
        raise ConfigError(f"cache bench: --lookahead must be >= 1, got {min(windows)}")
    return windows


def capacity(trace: Trace, fraction: float) -> int:
    """Rows a cache of ``fraction`` of the trace's table holds (at least 1)."""
    return max(1, int(fraction * trace.rows))


def run_trace(trace: Trace, fractions: list[float], windows: list[int], beyond: str = "lru") -> list[Cell]:
    """Every policy at every fraction on one trace (``beyond``: lookahead's victims outside the window)."""
    cells = []
    for fraction in fractions:
        c = capacity(trace, fraction)
        for k in windows:
            outcome = simulate(trace, c, "lookahead", k, beyond=beyond)
            cells.append(Cell(trace.name, fraction, k, "lookahead", outcome))
        for policy in ("lru", "lfu", "belady"):
            cells.append(Cell(trace.name, fraction, None, policy, simulate(trace, c, policy)))
    return cells


def trace_info(trace: Trace) -> dict:
    """What a trace is: size, batches, and the hit rate no cache can beat (first uses miss)."""
    unique = [len(b) for b in trace.batches]
    return {
        "trace": trace.name,
        "rows": trace.rows,
        "batches": len(trace.batches),
        "unique_rows_per_batch": round(float(np.mean(unique)), 1),
        "max_unique_rows": max(unique),
        "requested": trace.requested,
        "distinct": trace.distinct,
        "ceiling": 1.0 - trace.distinct / trace.requested,
        "description": trace.description,
    }


def _cell_text(cell: Cell) -> str:
    if cell.outcome.hit_rate is None:
        return f"infeasible: {cell.outcome.reason}"
    return f"{cell.outcome.hit_rate:.4f}"


def trace_table(trace: Trace, cells: list[Cell]) -> list[dict]:
    """Markdown rows of one trace: one per fraction, a column per policy."""
    table: dict[float, dict] = {}
    for cell in cells:
        row = table.setdefault(
            cell.cache_fraction,
            {"fraction": cell.cache_fraction, "rows cached": capacity(trace, cell.cache_fraction)},
        )
        row[cell.column] = _cell_text(cell)
    return list(table.values())


def findings(trace: Trace, cells: list[Cell]) -> str:
    """One line: lookahead's best cell against the better of LRU and LFU there, and Belady's lead."""
    rate = {(c.cache_fraction, c.column): c.outcome.hit_rate for c in cells}
    best = None
    for c in cells:
        lru, lfu, opt = (rate[(c.cache_fraction, p)] for p in ("lru", "lfu", "belady"))
        if c.policy != "lookahead" or c.outcome.hit_rate is None or lru is None:
            continue
        gain = c.outcome.hit_rate - max(lru, lfu)
        if best is None or gain > best[0]:
            best = (gain, c, opt)
    if best is None:
        return f"{trace.name}: no feasible lookahead cell."
    gain, c, opt = best
    return (
        f"{trace.name}: lookahead's best cell against the better of LRU/LFU: {100 * gain:+.2f} points "
        f"(k={c.lookahead}, {c.cache_fraction:g} of rows: {c.outcome.hit_rate:.4f}); "
        f"Belady there {opt:.4f}, {100 * (opt - c.outcome.hit_rate):.2f} points higher."
    )


def plot_hit_rates(traces: list[Trace], cells: list[Cell], path: str | Path) -> Path:
    """Hit rate against cache fraction: one panel per trace, a line per policy (gaps = infeasible)."""
    plt = pyplot()
    cols = min(3, len(traces))
    nrows = -(-len(traces) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
    styles = {"lru": ("k", "o", "--"), "lfu": ("tab:gray", "s", ":"), "belady": ("tab:red", "^", "-")}
    for ax, trace in zip(axes.flat, traces):
        mine = [c for c in cells if c.trace == trace.name]
        windows = sorted({c.lookahead for c in mine if c.lookahead is not None})
        blues = dict(zip(windows, plt.get_cmap("Blues")(np.linspace(0.5, 0.95, len(windows)))))
        for column in dict.fromkeys(c.column for c in mine):
            line = [c for c in mine if c.column == column]
            x = [c.cache_fraction for c in line]
            y = [np.nan if c.outcome.hit_rate is None else c.outcome.hit_rate for c in line]
            color, marker, style = styles.get(column) or (blues[line[0].lookahead], "D", "-")
            ax.plot(x, y, marker=marker, linestyle=style, color=color, label=column, markersize=4)
        ax.axhline(
            trace_info(trace)["ceiling"], color="tab:green", linewidth=0.8, label="ceiling (first uses)"
        )
        ax.set_xscale("log")
        fractions = sorted({c.cache_fraction for c in mine})
        ax.set_xticks(fractions, [f"{f:g}" for f in fractions])
        ax.minorticks_off()
        ax.set_xlim(fractions[0] / 1.2, fractions[-1] * 1.2)
        ax.set_title(trace.name, fontsize=10)
        ax.set_xlabel("cache fraction of rows")
        ax.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(traces) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        "Embedding cache hit rate (missing points: cache smaller than a batch or window; "
        "lookahead with LRU beyond the window transfers what lru does, so their lines coincide)",
        fontsize=9,
    )
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


NOTES = [
    "Simulation on ids (recaccel.bench.cache.policies): hit = a row of batch i still resident since its previous "
    "use; hit rate = 1 - rows transferred / unique rows requested (summed per batch). Rows prefetched ahead count as "
    "misses of the batch that needs them, so lookahead is compared on transfers, not on latency hiding.",
    "lookahead k: before batch i, the rows of batches i..i+k-1 are resident; victims only among rows none of them "
    "needs, least recently used first (k=1 = fetch on demand with LRU = lru). lru/lfu fetch on miss (lfu: lookup "
    "counts since the start, kept across evictions, ties to LRU); belady evicts the row next used farthest ahead "
    "(the offline optimum, an upper bound for every policy).",
    "With LRU beyond the window, lookahead transfers exactly the rows lru does for every feasible k (proved in "
    "recaccel.bench.cache.policies, checked by tests/bench/test_bench_cache.py): the window moves transfers earlier "
    "(off the critical path), it does not save any. --beyond lfu orders victims outside the window as lfu does.",
    "ceiling = 1 - distinct rows / requested: what an unbounded cache reaches (each row's first use misses).",
    "infeasible: the cache holds fewer rows than one batch (lookahead: one window of k batches) looks up.",
]


def run_cache_bench(args) -> tuple[list[Trace], list[Cell], list[str]]:
    """Loads the traces (skipping absent real ones) and replays every cell; returns traces, cells, skips."""
    fractions, windows = _fractions(args.fractions), _windows(args.lookahead)
    sizes = TraceSizes(args.zipf_rows, args.zipf_batch, args.zipf_batches, args.real_batch, args.seed)
    if min(sizes.zipf_rows, sizes.zipf_batch, sizes.zipf_batches) < 1:
        raise ConfigError("cache bench: --zipf-rows, --zipf-batch and --zipf-batches must be >= 1")
    traces, cells, skipped = [], [], []
    for spec in _list(args.traces, str, "--traces"):
        try:
            trace = load_trace(spec.strip(), sizes, Path(args.data))
        except MissingData as e:
            skipped.append(f"{spec}: skipped, {e} (real datasets are not copied into the repository)")
            log.warning("cache bench: %s", skipped[-1])
            continue
        log.info("cache bench: replaying %s", trace.name)
        traces.append(trace)
        cells += run_trace(trace, fractions, windows, args.beyond)
    if not traces:
        raise ConfigError(f"cache bench: no trace to replay ({'; '.join(skipped)})")
    return traces, cells, skipped


def write_json(
    path: str | Path, env: dict, command: str, traces, cells, skipped, beyond: str = "lru"
) -> Path:
    """``{"results": [...]}`` with metadata (environment, traces, infeasible reasons, skips) beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    infeasible = [{**c.result(), "reason": c.outcome.reason} for c in cells if c.outcome.reason]
    for row in infeasible:
        del row["hit_rate"]
    doc = {
        "env": env,
        "command": command,
        "lookahead_beyond_window": beyond,
        "traces": [trace_info(t) for t in traces],
        "infeasible": infeasible,
        "skipped": skipped,
        "results": [c.result() for c in cells],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def main(args, command_line: str) -> Path:
    """Runs the study; writes the markdown (and the plot, and the JSON when asked); returns the markdown's path."""
    traces, cells, skipped = run_cache_bench(args)
    env = environment_info("cpu")
    env["device"] = f"{env['device']}; a simulation on ids, machine-independent"
    if args.json:
        write_json(args.json, env, command_line, traces, cells, skipped, args.beyond)
    plot = plot_file(args)
    if plot is not None:
        plot_hit_rates(traces, cells, plot)
    summary = [{k: v for k, v in trace_info(t).items() if k != "description"} for t in traces]
    path = write_results_markdown(
        args.out,
        "Embedding cache hit rate: lookahead prefetch vs LRU, LFU and Belady",
        env,
        command_line,
        summary,
        NOTES + [f"lookahead's victims beyond the window this run: {args.beyond}"] + skipped,
    )
    parts = [""]
    if plot is not None and plot.parent.resolve() == path.parent.resolve():
        parts += [f"![{plot.name}]({plot.name})", ""]
    for trace in traces:
        mine = [c for c in cells if c.trace == trace.name]
        parts += [
            f"## {trace.name}",
            "",
            trace.description + ".",
            "",
            markdown_table(trace_table(trace, mine)),
        ]
        parts += [findings(trace, mine), ""]
    with open(path, "a") as f:
        f.write("\n".join(parts))
    return path
