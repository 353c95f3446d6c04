"""The harness of the kernel tuning runs (``recaccel-bench kernels``, ``interaction_tune``).

A sweep goes through its cases most important first within a time budget. Per case: the
candidate configs compile at once on a thread pool (CUDA), each is checked against the
default config's output (one that differs, or fails to compile or run, is dropped, not
timed), and the rest are timed alone, as ms, GB/s of the case's byte count and % of the
copy bandwidth measured in the same run. The JSON report is rewritten after every case,
so a run cut short keeps what it measured; the cases the budget leaves are listed as
skipped. The winners per tuning-table key are the configs with the least total time
relative to each case's best.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.timing import measure_copy_bandwidth
from recaccel.bench.kernels.sweep_cases import Candidate
from recaccel.errors import RecaccelError

log = logging.getLogger(__name__)

# A case is not started with less than this left: building its inputs and compiling its
# first configs can take that long, and the run must end within the budget plus startup.
CASE_RESERVE_S = 15.0


def resolve_device(bench: str, device_arg: str, budget_s: float) -> torch.device:
    """The sweep's device, checked; on the CPU the Triton interpreter is switched on
    (before the kernel modules are imported).

    Raises:
        RecaccelError: one line, for a device that is neither a present CUDA device nor
            the CPU, or a budget that is not positive.
    """
    device = torch.device(device_arg)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif device.type == "cuda" and not torch.cuda.is_available():
        raise RecaccelError(f"recaccel-bench {bench}: --device cuda, but torch sees no CUDA device")
    elif device.type != "cuda":
        raise RecaccelError(f"recaccel-bench {bench}: --device {device_arg}: expected cuda or cpu")
    if budget_s <= 0:
        raise RecaccelError(f"recaccel-bench {bench}: --budget-s {budget_s}: must be > 0")
    return device


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA (L2 flushed between calls), one call elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def compile_workers() -> int:
    """Threads compiling a case's configs at once: half the cores, at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def precompile(candidates: list[Candidate], workers: int, device: torch.device) -> None:
    """Runs each candidate once on ``workers`` threads, so that Triton compiles their
    configs at once (its compiler releases the GIL: the parallel compiles of Triton's own
    autotuner proposals and of Inductor), then waits for the device. The timing loop then
    finds every config compiled. Outputs are discarded; errors too (a config that fails
    is run again by the check, which drops it). Never under the Triton interpreter, which
    patches global state while a kernel runs.
    """
    if workers <= 1 or len(candidates) <= 1:
        return

    def run(candidate: Candidate) -> None:
        try:
            candidate.run()
        except Exception as exc:  # reported by the check's own run
            log.debug("precompile: %s: %s", candidate.fields, exc)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="recaccel-compile") as pool:
        list(pool.map(run, candidates))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_candidate(candidate: Candidate, want: torch.Tensor, tolerance: dict[str, float]) -> str | None:
    """None when the config compiles, runs and matches ``want``; else why not (one line)."""
    try:
        torch.testing.assert_close(candidate.run(), want, **tolerance)
    except Exception as exc:  # a config that fails to compile or run is dropped, not fatal
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return None


def time_candidates(
    label: str,
    candidates: dict[str, Candidate],
    names: Sequence[str],
    *,
    tolerance: dict[str, float],
    nbytes: int,
    copy_gbs: float,
    deadline: float,
    device: torch.device,
) -> dict[str, Any]:
    """Checks and times ``names`` of ``candidates`` (``"default"`` first among them) until ``deadline``.

    Returns:
        ``{"bytes", "configs": {name: {ms, gb_s, pct_copy, fields...}}, "dropped": {name: why},
        "best", "truncated"}``.
    """
    if device.type == "cuda":
        precompile([candidates[n] for n in names], compile_workers(), device)
    # A copy: candidates may share one output buffer, which the next run overwrites.
    want = candidates["default"].run().clone()
    timed: dict[str, dict] = {}
    dropped: dict[str, str] = {}
    truncated = False
    for name in names:
        if time.monotonic() > deadline:
            truncated = True
            break
        reason = check_candidate(candidates[name], want, tolerance)
        if reason is not None:
            dropped[name] = reason
            log.info("%s: dropped %s: %s", label, name, reason)
            continue
        c = candidates[name]
        ms = time_ms(c.timed or c.run, device)
        gb_s = nbytes / (ms * 1e-3) / 1e9
        timed[name] = {"ms": ms, "gb_s": gb_s, "pct_copy": 100 * gb_s / copy_gbs, **c.fields}
    best = min(timed, key=lambda n: timed[n]["ms"]) if timed else None
    if best is not None:
        log.info("%s: default %.1f%% of copy, best %s %.1f%%", label,
                 timed.get("default", {}).get("pct_copy", float("nan")), best, timed[best]["pct_copy"])  # fmt: skip
    return {"bytes": nbytes, "configs": timed, "dropped": dropped, "best": best, "truncated": truncated}


def run_cases(
    cases: Iterable[Any],
    sweep_one: Callable[[Any, float, float], dict],
    device: torch.device,
    device_key: str,
    json_path: Path,
    budget_s: float,
) -> dict:
    """Sweeps ``cases`` in order within ``budget_s``, rewriting ``json_path`` after each.

    Args:
        cases: The cases (each with a ``name``), most important first.
        sweep_one: ``(case, copy GB/s, deadline) -> record`` (the record holds ``key``).
        device: Where they run.
        device_key: The tuning table's name of the device.
        json_path: The report, rewritten after every case.
        budget_s: Seconds for the whole run.

    Returns:
        The report: ``env``, ``device_name``, ``copy_gb_s``, ``budget_s``, ``cases``
        (records), ``skipped`` (names), ``elapsed_s``.
    """
    start = time.monotonic()
    deadline = start + budget_s
    copy_gbs = measure_copy_bandwidth(device)
    report = {"env": environment_info(device), "device_name": device_key, "copy_gb_s": copy_gbs,
              "budget_s": budget_s, "cases": [], "skipped": []}  # fmt: skip
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        if time.monotonic() > deadline - min(CASE_RESERVE_S, budget_s / 4):
            report["skipped"].append(case.name)
        else:
            report["cases"].append(sweep_one(case, copy_gbs, deadline))
        report["elapsed_s"] = time.monotonic() - start
        json_path.write_text(json.dumps(report, indent=1))
    return report


def pick_winners(
    records: list[dict], entry: Callable[[dict, dict], dict[str, int]]
) -> dict[str, dict[str, int]]:
    """Per table key, the config with the least total time relative to each case's best,
    among configs timed in every case of that key (ties by name).

    Args:
        records: The cases' records (``key``, ``best``, ``configs``).
        entry: ``(winner's figures, its first record) -> table entry``.
    """
    by_key: dict[str, list[dict]] = {}
    for rec in records:
        if rec.get("best"):
            by_key.setdefault(rec["key"], []).append(rec)
    table = {}
    for key, recs in by_key.items():
        common = set.intersection(*(set(r["configs"]) for r in recs))
        if not common:
            continue

        def cost(name: str, recs=recs) -> float:
            return sum(r["configs"][name]["ms"] / r["configs"][r["best"]]["ms"] for r in recs)

        name = min(sorted(common), key=cost)
        table[key] = entry(recs[0]["configs"][name], recs[0])
    return table


def finish(
    report: dict,
    cuda: bool,
    args,
    title: str,
    command_line: str,
    winners: Callable[[list[dict]], dict[str, dict[str, int]]],
    write_table: Callable[[str, str, dict[str, dict[str, int]]], Path],
) -> Path:
    """Writes a sweep's markdown and, with ``args.write_table``, its ``winners`` of the
    cases through ``write_table(path, device name, entries)``; returns the markdown's path."""
    from recaccel.bench.harness.report import write_results_markdown

    notes = report_notes(report, cuda)
    if args.write_table:
        path = write_table(args.write_table, report["device_name"], winners(report["cases"]))
        notes.append(f"winners written to {path} for {report['device_name']}")
    rows = [summary_row(rec) for rec in report["cases"]]
    return write_results_markdown(args.out, title, report["env"], command_line, rows, notes)


def report_notes(report: dict, cuda: bool) -> list[str]:
    """The markdown's notes: the copy bandwidth, the skipped cases, what a CPU run means."""
    notes = [f"copy bandwidth {report['copy_gb_s']:.0f} GB/s (read + write), measured in this run",
             f"skipped for the budget: {', '.join(report['skipped']) or 'none'}"]  # fmt: skip
    if not cuda:
        notes.append(
            "CPU run under the Triton interpreter: checks the sweep runs; the times say nothing about a GPU"
        )
    return notes


def summary_row(rec: dict) -> dict:
    """One markdown row: the case, its configs, the default's and the best config's figures."""
    default = rec["configs"].get("default", {})
    best = rec["configs"].get(rec["best"], {}) if rec["best"] else {}
    return {
        "case": rec["name"],
        "configs timed": len(rec["configs"]),
        "dropped": len(rec["dropped"]),
        "default ms": default.get("ms"),
        "default % copy": default.get("pct_copy"),
        "best": rec["best"],
        "best ms": best.get("ms"),
        "best GB/s": best.get("gb_s"),
        "best % copy": best.get("pct_copy"),
    }
