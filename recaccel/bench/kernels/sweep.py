"""``recaccel-bench kernels``: the Triton embedding kernels' config sweep, sized for a short GPU loan.

One command on a lent H100/H200, under 6 minutes (``--budget-s`` 330 by default)::

    T=recaccel/ops/embedding/triton/tuning_table.py
    recaccel-bench kernels --json $OUT/kernels.json --out $OUT/kernels.md --write-table $T
    cp $T $OUT/   # commit it with the JSON

Per case (forward: D 16..256, L 1 / 20 / variable / Zipf, fp32 and bf16, T=26 B=16384 and
65536, T=500 B=4096 D=32; backward + fused row-wise Adagrad update: the same shapes with
Zipf hot rows; one-chunk tiles, then programs walking 4 and 16 chunks around the device's
tuned entry), most important first, it builds the seeded batch, runs the kernel's
default config (its heuristic, :func:`~recaccel.ops.embedding.triton.forward.forward_config`
/ :func:`~recaccel.ops.embedding.triton.backward.tile_config` without a device), compiles
every candidate config at once on a thread pool (:func:`precompile`, CUDA only), then for
each candidate config: its output checked against the default's (a config whose output
differs, or that fails to compile, is dropped, not timed), and the launch alone timed with ``triton.testing.do_bench``. Figures are GB/s
in the embedding benchmark's byte accounting and % of the device-to-device copy bandwidth
measured in the same run. The JSON is rewritten after every case, so a run cut short keeps
what it measured; when the budget runs out, the case in progress stops timing and the
remaining cases are listed as skipped. ``--write-table PATH`` merges each shape key's
winner into a generated table module (the package's is
``recaccel/ops/embedding/triton/tuning_table.py``), keyed by the device name, which the
kernels read at launch. ``--device cpu`` runs 2 tiny cases of 2 configs each under the
Triton interpreter (a check that everything runs; its times mean nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, write_results_markdown
from recaccel.bench.harness.timing import measure_copy_bandwidth
from recaccel.bench.kernels.sweep_cases import (
    CPU_CASES,
    Candidate,
    KernelCase,
    backward_candidates,
    forward_candidates,
    gpu_cases,
)
from recaccel.errors import RecaccelError

log = logging.getLogger(__name__)

# A case is not started with less than this left: building its batch and compiling its
# first configs can take that long, and the run must end within the budget plus startup.
CASE_RESERVE_S = 15.0


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- configs


def _tolerance(case: KernelCase) -> dict[str, float]:
    """Configs sum in different orders: float32 rounding, plus one stochastic-rounding step of 16-bit rows."""
    if case.dtype == "float32":
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 2.0**-7, "atol": 1e-4}


# --------------------------------------------------------------------------- timing


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA (L2 flushed between calls), one call elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def sweep_case(
    case: KernelCase,
    device: torch.device,
    copy_gbs: float,
    deadline: float,
    max_configs: int | None = None,
    extra: dict[str, Candidate] | None = None,
) -> dict:
    """Checks and times the configs of one case until ``deadline`` (``time.monotonic``).

    Args:
        case: The shape.
        device: Where it runs.
        copy_gbs: The copy bandwidth of this run (the % column).
        deadline: Stop timing further configs after this instant (the case is then ``truncated``).
        max_configs: Time at most this many configs, the default included (all when None).
        extra: More candidates (name -> Candidate), tried after the default (a test hook).

    Returns:
        The case's record: its shape, bytes, each timed config's figures, dropped configs
        with the reason, the best config's name.
    """
    build = forward_candidates if case.kernel == "forward" else backward_candidates
    candidates, nbytes = build(case, device)
    names = list(candidates)
    if extra:
        candidates.update(extra)
        names = names[:1] + list(extra) + names[1:]
    if max_configs is not None:
        names = names[:max_configs]
    if device.type == "cuda":
        precompile([candidates[n] for n in names], compile_workers(), device)
    # A copy: the forward's candidates share one output buffer, which the next run overwrites.
    want = candidates["default"].run().clone()
    timed: dict[str, dict] = {}
    dropped: dict[str, str] = {}
    truncated = False
    for name in names:
        if time.monotonic() > deadline:
            truncated = True
            break
        reason = _check(candidates[name], want, case)
        if reason is not None:
            dropped[name] = reason
            log.info("%s: dropped %s: %s", case.name, name, reason)
            continue
        c = candidates[name]
        ms = _time_ms(c.timed or c.run, device)
        gb_s = nbytes / (ms * 1e-3) / 1e9
        timed[name] = {"ms": ms, "gb_s": gb_s, "pct_copy": 100 * gb_s / copy_gbs, **c.fields}
    best = min(timed, key=lambda n: timed[n]["ms"]) if timed else None
    if best is not None:
        log.info("%s: default %.1f%% of copy, best %s %.1f%%", case.name,
                 timed.get("default", {}).get("pct_copy", float("nan")), best, timed[best]["pct_copy"])  # fmt: skip
    return {"case": dataclasses.asdict(case), "name": case.name, "bytes": nbytes, "configs": timed,
            "dropped": dropped, "best": best, "truncated": truncated}  # fmt: skip


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


def _check(candidate: Candidate, want: torch.Tensor, case: KernelCase) -> str | None:
    """None when the config compiles, runs and matches the default's output; else why not."""
    try:
        got = candidate.run()
        torch.testing.assert_close(got, want, **_tolerance(case))
    except Exception as exc:  # a config that fails to compile or run is dropped, not fatal
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


# --------------------------------------------------------------------------- table


def shape_key(case: KernelCase) -> str:
    """The tuning table's key of a case's kernel and shape."""
    from recaccel.ops.embedding.triton import tuning
    from recaccel.ops.embedding.triton.forward import length_bucket

    if case.kernel == "forward":
        return tuning.forward_key(case.dim, length_bucket(case.mean_len), case.dtype)
    return tuning.backward_key(case.dim, case.dtype)


def winners(records: list[dict]) -> dict[str, dict[str, int]]:
    """Per shape key, the config with the least total time relative to each case's best,
    among configs timed in every case of that key."""
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
        table[key] = _fields(recs[0]["configs"][name], recs[0]["case"]["kernel"])
    return table


def _fields(figures: dict, kernel: str) -> dict[str, int]:
    """A winner's table entry; a backward one has ``subtiles`` only when above 1 (absent: 1)."""
    if kernel == "forward":
        return {k: int(figures[k]) for k in ("block_bags", "num_warps", "unroll", "long_threshold")}
    entry = {k: int(figures[k]) for k in ("block_occ", "num_warps")}
    if int(figures.get("subtiles", 1)) != 1:
        entry["subtiles"] = int(figures["subtiles"])
    return entry


# --------------------------------------------------------------------------- CLI


def add_args(parser) -> None:
    """The benchmark's options."""
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if present)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="whole run's time budget (default %(default)s)"
    )
    parser.add_argument(
        "--json", default="runs/bench/kernels.json", help="results file, rewritten after every case"
    )
    parser.add_argument(
        "--write-table", help="merge the winners into this tuning-table module, keyed by device"
    )
    add_output_args(parser, "kernels")


def run_sweep(
    cases: list[KernelCase],
    device: torch.device,
    json_path: Path,
    budget_s: float,
    max_configs: int | None = None,
    extra: dict[str, dict[str, Candidate]] | None = None,
) -> dict:
    """Sweeps ``cases`` in order within ``budget_s``, rewriting ``json_path`` after each case.

    Args:
        cases: The shapes, most important first.
        device: Where to run.
        json_path: The report, rewritten after every case.
        budget_s: Seconds for the whole run; cases left when it is spent are listed as skipped.
        max_configs: Configs per case (all when None).
        extra: case name -> more candidates for that case (a test hook, see :func:`sweep_case`).

    Returns:
        The report (what ``json_path`` holds).
    """
    start = time.monotonic()
    deadline = start + budget_s
    copy_gbs = measure_copy_bandwidth(device)
    report = {"env": environment_info(device), "device_name": _device_key(device), "copy_gb_s": copy_gbs,
              "budget_s": budget_s, "cases": [], "skipped": []}  # fmt: skip
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        if time.monotonic() > deadline - min(CASE_RESERVE_S, budget_s / 4):
            report["skipped"].append(case.name)
        else:
            record = sweep_case(case, device, copy_gbs, deadline, max_configs, (extra or {}).get(case.name))
            record["key"] = shape_key(case)
            report["cases"].append(record)
        report["elapsed_s"] = time.monotonic() - start
        json_path.write_text(json.dumps(report, indent=1))
    return report


def _device_key(device: torch.device) -> str:
    from recaccel.ops.embedding.triton import tuning

    return tuning.device_name(device)


def main(args, command_line: str) -> Path:
    """Runs the sweep; writes the JSON, the markdown and (``--write-table``) the table; returns the markdown."""
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
    elif device.type == "cuda" and not torch.cuda.is_available():
        raise RecaccelError("recaccel-bench kernels: --device cuda, but torch sees no CUDA device")
    elif device.type != "cuda":
        raise RecaccelError(f"recaccel-bench kernels: --device {args.device}: expected cuda or cpu")
    if args.budget_s <= 0:
        raise RecaccelError(f"recaccel-bench kernels: --budget-s {args.budget_s}: must be > 0")
    cuda = device.type == "cuda"
    report = run_sweep(
        gpu_cases() if cuda else CPU_CASES, device, Path(args.json), args.budget_s, None if cuda else 2
    )
    notes = [f"copy bandwidth {report['copy_gb_s']:.0f} GB/s (read + write), measured in this run",
             f"skipped for the budget: {', '.join(report['skipped']) or 'none'}"]  # fmt: skip
    if not cuda:
        notes.append(
            "CPU run under the Triton interpreter: checks the sweep runs; the times say nothing about a GPU"
        )
    if args.write_table:
        from recaccel.ops.embedding.triton import tuning

        path = tuning.write_table(args.write_table, report["device_name"], winners(report["cases"]))
        notes.append(f"winners written to {path} for {report['device_name']}")
    rows = [_summary_row(rec) for rec in report["cases"]]
    return write_results_markdown(
        args.out, "Embedding kernel config sweep", report["env"], command_line, rows, notes
    )


def _summary_row(rec: dict) -> dict:
    default = rec["configs"].get("default", {})
    best = rec["configs"].get(rec["best"], {}) if rec["best"] else {}
    return {
        "case": rec["name"],
        "configs timed": len(rec["configs"]),
        "dropped": len(rec["dropped"]),
        "default % copy": default.get("pct_copy"),
        "best": rec["best"],
        "best ms": best.get("ms"),
        "best GB/s": best.get("gb_s"),
        "best % copy": best.get("pct_copy"),
    }
