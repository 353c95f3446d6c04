"""The straggler benchmark's results (see :mod:`recaccel.bench.distributed.straggler`): rows counted and
samples/s timed from the ranks' step records, the markdown report and the plot."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recaccel.bench.harness.report import write_results_markdown
from recaccel.plotting import pyplot, save_figure

# name -> (parallel.straggler, parallel.data, slowed)
SCENARIOS: dict[str, tuple[str, str, bool]] = {
    "clean": ("off", "global", False),
    "clean_dynamic": ("off", "dynamic", False),  # backup's baseline: the same data path
    "slowed": ("off", "global", True),
    "rebalance": ("rebalance", "global", True),
    "backup": ("backup", "dynamic", True),
}
RECOVER_TARGET = 0.85  # mitigated samples/s: this share of clean
DETECT_TARGET = 20  # steps until the slow rank is flagged

COLORS = {
    "clean": "tab:green",
    "clean_dynamic": "tab:olive",
    "slowed": "tab:red",
    "rebalance": "tab:blue",
    "backup": "tab:purple",
}


def baseline(name: str) -> str:
    """The clean scenario a scenario is compared with: the one reading data the same way
    (``global``: every rank decodes the global batch; ``dynamic``: only its own shards)."""
    return "clean_dynamic" if SCENARIOS[name][1] == "dynamic" else "clean"


# ----------------------------------------------------------------- analysis

Steps = list[list[tuple[float, list[int]]]]  # per rank, per step: (start time, row ids trained)


def count_rows(steps: Steps, rows: int) -> tuple[int, int]:
    """(rows lost, rows repeated) of one epoch: ids in ``range(rows)`` never trained, and
    trainings beyond each id's first (an id outside the range counts as repeated).

    Args:
        steps: per rank, per step, (start time, row ids trained).
        rows: the epoch's rows.
    """
    seen = Counter(i for rank in steps for _, ids in rank for i in ids)
    lost = sum(1 for i in range(rows) if seen[i] == 0)
    outside = sum(c for i, c in seen.items() if not 0 <= i < rows)
    return lost, sum(c - 1 for i, c in seen.items() if c > 1 and 0 <= i < rows) + outside


def throughput(steps: Steps, warmup: int) -> tuple[float, list[float]]:
    """Samples/s over the steps after ``warmup`` (from rank 0's step starts), and every
    step's time in ms (rank 0's start to the next start; the last step has none).

    Args:
        steps: per rank, per step, (start time, row ids trained).
        warmup: untimed first steps.
    """
    n = min(len(rank) for rank in steps)
    starts = [t for t, _ in steps[0][:n]]
    rows = [sum(len(rank[s][1]) for rank in steps) for s in range(n)]
    first = min(warmup, n - 2)
    rate = sum(rows[first : n - 1]) / max(starts[n - 1] - starts[first], 1e-9)
    return rate, [(b - a) * 1e3 for a, b in zip(starts, starts[1:])]


def detect_step(metrics: Mapping[str, Any], slow_rank: int) -> int | None:
    """The step the monitor first flagged ``slow_rank``'s compute (metrics.json), else None."""
    flags = metrics.get("monitor", {}).get("flags", [])
    hits = [f["step"] for f in flags if f["rank"] == slow_rank and f["kind"] == "compute"]
    return min(hits) if hits else None


def run_stats(run: Mapping[str, Any], rows: int, warmup: int, slow_rank: int) -> dict[str, Any]:
    """One run's figures (its step records and metrics.json)."""
    steps, metrics = run["steps"], run["metrics"]
    lost, repeated = count_rows(steps, rows)
    rate, step_ms = throughput(steps, warmup)
    half = len(steps[0]) // 2
    late, _ = throughput([rank[half:] for rank in steps], 0)
    return {
        "samples_per_s": rate,
        "second_half_samples_per_s": late,
        "trainer_samples_per_s": metrics.get("samples_per_s"),
        "steps": len(steps[0]),
        "rows_lost": lost,
        "rows_repeated": repeated,
        "detect_step": detect_step(metrics, slow_rank),
        "local_batches": [list(b) for b in zip(*([len(ids) for _, ids in rank] for rank in steps))],
        "monitor_flags": metrics.get("monitor", {}).get("flags", []),
        "monitor_ranks": {
            r: {k: m[k] for k in ("step_s", "compute_s", "comm_s")}
            for r, m in metrics.get("monitor", {}).get("ranks", {}).items()
        },
        "step_ms": step_ms,
    }


def analyse(args, runs: Mapping[str, list[Mapping[str, Any]]], rows: int) -> dict[str, Any]:
    """The JSON result: the issue's keys, then per-scenario detail.

    Per scenario: samples/s is the median over rounds (each round's in ``rounds``); rows
    lost and repeated are summed over rounds; step records, flags and monitor medians are
    round 1's. ``detect_steps`` is the latest round's flag step of the ``slowed`` runs
    (None if a round never flagged the slow rank).
    """
    scenarios: dict[str, dict[str, Any]] = {}
    for name, rounds in runs.items():
        refused = [r["refused"] for r in rounds if "refused" in r]
        if refused:
            scenarios[name] = {"refused": refused[0]}
            continue
        stats = [run_stats(r, rows, args.warmup, args.ranks - 1) for r in rounds]
        first = stats[0]
        scenarios[name] = {
            **{
                k: statistics.median(s[k] for s in stats)
                for k in ("samples_per_s", "second_half_samples_per_s")
            },
            "trainer_samples_per_s": statistics.median(s["trainer_samples_per_s"] or 0.0 for s in stats),
            "steps": first["steps"],
            "rows_lost": sum(s["rows_lost"] for s in stats),
            "rows_repeated": sum(s["rows_repeated"] for s in stats),
            "local_batch_last": first["local_batches"][-1],
            **{k: first[k] for k in ("monitor_flags", "monitor_ranks", "local_batches", "step_ms")},
            "rounds": [
                {k: s[k] for k in ("samples_per_s", "rows_lost", "rows_repeated", "detect_step")}
                for s in stats
            ],
        }
    for name, s in scenarios.items():
        clean = scenarios.get(baseline(name), {}).get("samples_per_s")
        if clean and "samples_per_s" in s:
            s["vs_clean"] = s["samples_per_s"] / clean
    detects = [r["detect_step"] for r in scenarios.get("slowed", {}).get("rounds", [])]
    counted = [s for s in scenarios.values() if "rows_lost" in s]
    return {
        **{f"{n}_samples_per_s": scenarios.get(n, {}).get("samples_per_s") for n in SCENARIOS},
        "detect_steps": max(detects) if detects and None not in detects else None,
        "rows_lost": sum(s["rows_lost"] for s in counted),
        "rows_repeated": sum(s["rows_repeated"] for s in counted),
        "scenarios": scenarios,
    }


# ------------------------------------------------------------------- report


def table_rows(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One markdown row per scenario."""
    rows = []
    for name, s in result["scenarios"].items():
        straggler, data, slowed = SCENARIOS[name]
        row: dict[str, Any] = {
            "scenario": name,
            "parallel.data": data,
            "straggler": straggler,
            "slowed": "yes" if slowed else "no",
        }
        if "refused" in s:
            rows.append({**row, "samples_per_s": None, "note": f"refused: {s['refused']}"})
            continue
        first = [f["step"] for f in s["monitor_flags"] if f["kind"] == "compute"]
        rows.append(
            {
                **row,
                "samples_per_s": s["samples_per_s"],
                "vs_clean": s.get("vs_clean"),
                "rounds_samples_per_s": " / ".join(f"{r['samples_per_s']:.0f}" for r in s["rounds"]),
                "second_half_samples_per_s": s["second_half_samples_per_s"],
                "median_step_ms": statistics.median(s["step_ms"]) if s["step_ms"] else None,
                "steps": s["steps"],
                "rows_lost": s["rows_lost"],
                "rows_repeated": s["rows_repeated"],
                "last_local_batches": "/".join(map(str, s["local_batch_last"])),
                "first_flag_step": min(first) if first else None,
            }
        )
    return rows


def verdicts(result: Mapping[str, Any]) -> list[str]:
    """The issue's three targets, each met / not met with its figure."""
    out = []
    for name in ("rebalance", "backup"):
        rate, clean = result[f"{name}_samples_per_s"], result[f"{baseline(name)}_samples_per_s"]
        if rate is None or not clean:
            out.append(f"{name}: not measured (see the table).")
            continue
        share = rate / clean
        verdict = "met" if share >= RECOVER_TARGET else "not met"
        out.append(
            f"{name} recovers {share:.1%} of {baseline(name)}'s samples/s (target >= {RECOVER_TARGET:.0%}): "
            f"{verdict}."
        )
    detect = result["detect_steps"]
    if detect is None:
        out.append(f"Detection: the slow rank was never flagged (target <= {DETECT_TARGET} steps): not met.")
    else:
        verdict = "met" if detect <= DETECT_TARGET else "not met"
        out.append(f"Detection: slow rank flagged at step {detect} (target <= {DETECT_TARGET}): {verdict}.")
    lost, repeated = result["rows_lost"], result["rows_repeated"]
    verdict = "met" if lost == repeated == 0 else "not met"
    out.append(f"Rows over all scenarios: {lost} lost, {repeated} repeated (target 0 and 0): {verdict}.")
    return out


def write_markdown(
    path: Path,
    env: Mapping,
    command: str,
    setup: Mapping[str, Any],
    result: Mapping[str, Any],
    plot: Path | None,
) -> Path:
    """Writes the report: environment, command, per-scenario table, setup and verdicts."""
    notes = [
        f"{setup['ranks']} gloo ranks on CPU, one process and one thread each; rank {setup['slow_rank']} "
        f"slowed {setup['slow_factor']:g}x by fault.slow_rank: when its pooled embeddings' gradient is ready "
        f"(before the backward all-to-all) it sleeps {setup['slow_factor'] - 1:g} x its own compute of the step, "
        "overlapping the other ranks' compute as a slower device would; the monitor and the controllers "
        "count the sleep as its compute; parallel.sharding=table_wise; one epoch of "
        f"{setup['rows']} rows per scenario, {setup['batch_per_rank']} rows per rank per step "
        f"(global batch {setup['ranks'] * setup['batch_per_rank']}), dense MLPs {setup['mlp']} wide.",
        f"{setup['repeats']} rounds of the scenarios in one process group, interleaved "
        "(clean, clean_dynamic, slowed, rebalance, backup, clean, ...); samples_per_s is the median over rounds "
        "(each round's in rounds_samples_per_s), timed here from rank 0's step starts (recorded by "
        "a step observer; ranks start a step together after its agreement) over the steps "
        f"after the first {setup['warmup_steps']}, rows being each step's local batches summed over ranks. "
        "second_half_samples_per_s: the epoch's second half only (the controllers settled). "
        "metrics.json's samples_per_s (whole epoch, warm-up included) is in the JSON as "
        "trainer_samples_per_s. vs_clean: against the clean run reading data the same way "
        "(parallel.data=global: every rank decodes the whole global batch; dynamic: only its own "
        "shards, less host work): clean for slowed and rebalance, clean_dynamic for backup.",
        "Bound: a rank s times slower leaves W - 1 + 1/s ranks' worth of speed, so rebalancing "
        "can reach at most (W - 1 + 1/s) / W of clean (87.5% for 4 ranks and 2x, 75% for 2) when "
        "each rank has its own core; figures above that are the contention below.",
        "Rows: dense column 0 holds each row's index; every trained local batch's ids are counted per "
        "epoch: lost = never trained, repeated = trained more than once; summed over rounds.",
        "Detection: the step at which the slowed run's metrics.json monitor.flags first names the "
        f"slow rank's compute (monitor.every={setup['monitor_every']}, slow_steps={setup['monitor_slow_steps']}, "
        f"slow_factor={setup['monitor_slow_factor']:g}); the latest over rounds. "
        "first_flag_step: any rank's first compute flag in round 1 (none expected in clean).",
        "last_local_batches: each rank's rows in the epoch's last step of round 1 (rebalance / "
        "backup: the shares the controller settled on; backup ends with ranks out of shards "
        "joining with empty batches).",
        "This machine is shared with other jobs and has fewer cores than ranks: expect noise "
        "between rounds (see rounds_samples_per_s). With fewer cores than ranks the clean run's "
        "ranks contend for the CPU, while a slow rank that mostly sleeps frees a core for the "
        "others, so the slowed runs' samples/s, and the recovery shares above all, read high "
        "against clean here; on one core (or device) per rank they would read lower.",
        *verdicts(result),
    ]
    notes.append(f"Plot: {plot.name}." if plot is not None else "No plot written.")
    return write_results_markdown(
        path, "Straggler mitigation: one slowed rank", env, command, table_rows(result), notes=notes
    )


def write_plot(path: Path, result: Mapping[str, Any], setup: Mapping[str, Any]) -> Path:
    """Samples/s per scenario with the 85%-of-clean line; round 1's step times per step."""
    plt = pyplot()
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(12, 4.8))
    fig.suptitle(
        f"{setup['ranks']} gloo ranks, rank {setup['slow_rank']} slowed {setup['slow_factor']:g}x (fault.slow_rank)"
    )
    measured = {n: s for n, s in result["scenarios"].items() if "samples_per_s" in s}
    names = list(measured)
    bars.bar(names, [measured[n]["samples_per_s"] for n in names], color=[COLORS[n] for n in names])
    for clean_name, style in (("clean", "--"), ("clean_dynamic", ":")):
        clean = result.get(f"{clean_name}_samples_per_s")
        if clean:
            bars.axhline(
                RECOVER_TARGET * clean,
                color="black",
                linestyle=style,
                label=f"{RECOVER_TARGET:.0%} of {clean_name}",
            )
    if any(result.get(f"{c}_samples_per_s") for c in ("clean", "clean_dynamic")):
        bars.legend(loc="lower right")
    bars.set_ylabel("samples/s (after warm-up)")
    bars.set_title("Throughput per scenario")
    for name in names:
        ms = measured[name]["step_ms"]
        lines.plot(range(1, len(ms) + 1), ms, color=COLORS[name], label=name, linewidth=0.8)
    if result["detect_steps"] is not None:
        lines.axvline(result["detect_steps"], color="tab:red", linestyle=":", label="slow rank flagged")
    lines.set_xlabel("step")
    lines.set_ylabel("step time (ms, rank 0)")
    lines.set_title("Step time per step")
    lines.legend(loc="upper right")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
