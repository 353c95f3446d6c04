"""The straggler benchmark's markdown report and plot (see :mod:`recaccel.bench.straggler`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recaccel.bench.common import pyplot, save_figure, write_results_markdown
from recaccel.bench.straggler import DETECT_TARGET, RECOVER_TARGET, SCENARIOS

COLORS = {"clean": "tab:green", "slowed": "tab:red", "rebalance": "tab:blue", "backup": "tab:purple"}


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
    clean = result["clean_samples_per_s"]
    for name in ("rebalance", "backup"):
        rate = result[f"{name}_samples_per_s"]
        if rate is None or not clean:
            out.append(f"{name}: not measured (see the table).")
            continue
        share = rate / clean
        verdict = "met" if share >= RECOVER_TARGET else "not met"
        out.append(
            f"{name} recovers {share:.0%} of clean samples/s (target >= {RECOVER_TARGET:.0%}): {verdict}."
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
        f"slowed {setup['slow_factor']:g}x (fault.slow_rank: it sleeps {setup['slow_factor'] - 1:g} x its "
        "compute after backward); parallel.sharding=table_wise; one epoch of "
        f"{setup['rows']} rows per scenario, {setup['batch_per_rank']} rows per rank per step "
        f"(global batch {setup['ranks'] * setup['batch_per_rank']}), dense MLPs {setup['mlp']} wide.",
        f"samples/s: timed here from rank 0's step starts (recorded by HybridParallel.on_batch; ranks "
        f"start a step together after its agreement), over the steps after the first {setup['warmup_steps']}; "
        "rows are each step's local batches summed over ranks. metrics.json's samples_per_s "
        "(whole epoch, warm-up included) is in the JSON as trainer_samples_per_s.",
        "Rows: dense column 0 holds each row's index; every trained local batch's ids are counted per "
        "epoch: lost = never trained, repeated = trained more than once.",
        "Detection: the step at which the slowed run's metrics.json monitor.flags first names the "
        "slow rank (compute).",
        *verdicts(result),
    ]
    notes.append(f"Plot: {plot.name}." if plot is not None else "No plot written.")
    return write_results_markdown(
        path, "Straggler mitigation: one slowed rank", env, command, table_rows(result), notes=notes
    )


def write_plot(path: Path, result: Mapping[str, Any]) -> Path:
    """Samples/s per scenario with the 85%-of-clean line; step times of each run per step."""
    plt = pyplot()
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(12, 4.5))
    measured = {n: s for n, s in result["scenarios"].items() if "samples_per_s" in s}
    names = list(measured)
    bars.bar(names, [measured[n]["samples_per_s"] for n in names], color=[COLORS[n] for n in names])
    clean = result["clean_samples_per_s"]
    if clean:
        bars.axhline(
            RECOVER_TARGET * clean, color="black", linestyle="--", label=f"{RECOVER_TARGET:.0%} of clean"
        )
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
