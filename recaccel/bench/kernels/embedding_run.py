"""Runner of the embedding benchmark: checks, interleaved timing, targets, plot.

For every case (T tables, B, D, L; see :mod:`recaccel.bench.kernels.embedding_cases`) all
candidates are built from the same initial rows, checked against the reference on the
benchmark's own inputs (forward, and forward after one train step), then timed in one
process, interleaved (:func:`recaccel.bench.harness.timing.time_interleaved`), median of many
repeats, in two modes: forward only, and forward + backward + optimizer update (fused
inside backward for the packed candidates; ``zero_grad`` + backward + ``step`` of a torch
optimizer on sparse gradients for the per-table loop). Repeat ``k`` of every candidate
reads batch ``k % K``. Rows report median ms, the speedup over the per-table loop and,
on CUDA, GB/s on the minimum traffic (:func:`~recaccel.bench.kernels.embedding_cases.bytes_moved`)
and its fraction of the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.timing import measure_copy_bandwidth, time_interleaved
from recaccel.bench.kernels.embedding_cases import (
    MODES,
    BenchInputs,
    Candidate,
    CandidateFactory,
    CandidateUnavailable,
    EmbeddingCase,
    bytes_moved,
    check_candidates,
    default_factories,
    initial_rows,
    make_inputs,
    mode_calls,
)
from recaccel.bench.kernels.embedding_profile import CaseProfiles, profile_note
from recaccel.errors import ConfigError
from recaccel.plotting import pyplot, save_figure

log = logging.getLogger(__name__)

BASELINE = "per_table"
REFERENCE = "reference"
TRITON = "triton"

# Target of the issue, checked when the case is in the run: (device type, T, B, D, L, mode, min speedup).
TARGETS = (("cpu", 1000, 512, 16, 1, "train", 2.0),)


def _timed_callables(cands: Mapping[str, Candidate], inputs: BenchInputs) -> dict[str, Callable[[], object]]:
    return {
        f"{name}/{mode}": call
        for name, cand in cands.items()
        for mode, call in mode_calls(cand, inputs).items()
    }


def bench_case(
    case: EmbeddingCase,
    factories: Mapping[str, CandidateFactory],
    device: torch.device,
    repeats: int,
    warmup: int,
    num_batches: int,
    copy_gbps: float | None,
    seed: int = 0,
    profiles: CaseProfiles | None = None,
) -> tuple[list[dict], dict[str, str]]:
    """Checks and times every candidate on one case, then profiles the packed ones into
    ``profiles`` when given (:mod:`~recaccel.bench.kernels.embedding_profile`).

    Returns:
        (two rows, forward and fwd+bwd+update; candidate -> why it was skipped).

    Raises:
        ConfigError: no ``reference`` or ``per_table`` factory.
        CandidateMismatchError: a candidate computes something else than the reference.
    """
    for required in (REFERENCE, BASELINE):
        if required not in factories:
            raise ConfigError(
                f"embedding bench: the {required!r} candidate is required, got {list(factories)}"
            )
    inputs = make_inputs(case, num_batches, device, seed)
    init = initial_rows(case, seed)
    cands, skipped = {}, {}
    for name, factory in factories.items():
        try:
            cands[name] = factory(case, init, device)
        except CandidateUnavailable as e:
            skipped[name] = str(e)
            log.info("embedding bench: skipping %s: %s", name, e)
    del init
    check_candidates(cands, REFERENCE, inputs, case)
    ms = time_interleaved(_timed_callables(cands, inputs), repeats, warmup, device)
    if profiles is not None:
        profiles.add_case(case, cands, inputs, device, skip=profile_skips(cands, device))
    num_ids = sum(int(sf.values.numel()) for sf in inputs.batches) / num_batches
    unique = sum(inputs.unique_rows) / num_batches
    moved = dict(zip(MODES, bytes_moved(case, round(num_ids), round(unique))))
    rows = []
    for mode, label in MODES.items():
        row = {
            "mode": label,
            "T": case.tables,
            "B": case.batch,
            "D": case.dim,
            "L": case.bag_len,
            "R": case.rows,
        }
        for name in cands:
            row[f"{name}_ms"] = ms[f"{name}/{mode}"]
        for name in cands:
            if name != BASELINE:
                row[f"{name}_x"] = ms[f"{BASELINE}/{mode}"] / ms[f"{name}/{mode}"]
        if copy_gbps is not None:
            for name in cands:
                gbps = moved[mode] / (ms[f"{name}/{mode}"] * 1e-3) / 1e9
                row[f"{name}_GBps"] = gbps
                row[f"{name}_bw_frac"] = gbps / copy_gbps
        row["MB_moved"] = moved[mode] / 1e6
        rows.append(row)
    del cands, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, skipped


def profile_skips(cands: Mapping[str, Candidate], device: torch.device) -> tuple[str, ...]:
    """The candidates ``--profile`` leaves out: the per-table baseline, and on CUDA every one
    but Triton's (the one the targets judge; the reference is the specification, and each
    profile costs seconds of gpu-check's budget)."""
    keep = [TRITON] if device.type == "cuda" and TRITON in cands else [n for n in cands if n != BASELINE]
    return tuple(n for n in cands if n not in keep)


def evaluate_targets(rows: Sequence[dict], device: torch.device) -> list[dict]:
    """Whether each :data:`TARGETS` entry present in ``rows`` is met, per packed candidate."""
    out = []
    for dev, t, b, d, l, mode, min_x in TARGETS:
        if device.type != dev:
            continue
        for row in rows:
            if (row["T"], row["B"], row["D"], row["L"], row["mode"]) != (t, b, d, l, MODES[mode]):
                continue
            for key, value in row.items():
                if key.endswith("_x"):
                    out.append(
                        {
                            "target": f"{dev} T={t} B={b} D={d} L={l} {MODES[mode]}: >= {min_x}x per-table",
                            "candidate": key.removesuffix("_x"),
                            "speedup": value,
                            "met": value >= min_x,
                        }
                    )
    return out


def run_embedding_bench(
    cases: Sequence[EmbeddingCase],
    device: torch.device | str,
    repeats: int,
    *,
    warmup: int = 2,
    num_batches: int = 4,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    factories: Mapping[str, CandidateFactory] | None = None,
    extra_candidates: Mapping[str, CandidateFactory] | None = None,
    seed: int = 0,
    profile_path: str | Path | None = None,
    on_case: Callable[[dict], object] | None = None,
) -> dict:
    """Runs the sweep.

    Args:
        cases: The settings, in order.
        device: Where to run. Triton is timed only on CUDA (never its interpreter).
        repeats: Timed calls per candidate and mode (median reported).
        warmup: Untimed calls per candidate and mode (after the correctness checks).
        num_batches: K distinct batches per case, cycled over the repeats.
        json_path: If given, the returned dict is written there as JSON.
        plot_path: If given, a PNG of speedup vs T (see :func:`plot_speedups`).
        factories: The candidates (default :func:`default_factories`); must include
            ``per_table`` (the baseline) and ``reference`` (the truth of the checks).
        extra_candidates: Added to ``factories`` (e.g. a candidate under development).
        seed: Seed of the initial rows and of the inputs.
        profile_path: If given, the packed candidates of every case (on CUDA Triton's:
            :func:`profile_skips`) are profiled after their timing and their kernel tables
            written there (markdown; host ops beside it): see
            :mod:`~recaccel.bench.kernels.embedding_profile`. A profiler failure ends the
            profiling, not the benchmark.
        on_case: Called after every case with the result so far (the caller's markdown:
            a run killed at a time budget keeps the cases done, as the JSON does).

    Returns:
        ``{"env", "copy_GBps", "cases", "results" (one row per case and mode), "skipped"
        (candidate -> reason, first seen), "targets", and with ``profile_path`` "profile"
        (the note naming the profile's files, or why there are none)}``.

    Raises:
        CandidateMismatchError: a candidate disagrees with the reference (nothing is timed
            for that case and the sweep stops).
    """
    device = torch.device(device)
    if repeats < 1:
        raise ConfigError(f"embedding bench: repeats must be >= 1, got {repeats}")
    if num_batches < 1:
        raise ConfigError(f"embedding bench: num_batches must be >= 1, got {num_batches}")
    factories = dict(factories if factories is not None else default_factories(seed))
    factories.update(extra_candidates or {})
    copy_gbps = measure_copy_bandwidth(device) if device.type == "cuda" else None
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    profiles = None if profile_path is None else CaseProfiles(profile_path)
    for case in cases:
        log.info("embedding bench: %s", case)
        case_rows, case_skipped = bench_case(
            case, factories, device, repeats, warmup, num_batches, copy_gbps, seed, profiles
        )
        rows += case_rows
        for name, why in case_skipped.items():
            skipped.setdefault(name, why)
        so_far = _result(device, copy_gbps, cases, rows, skipped, profiles)
        if json_path is not None:  # after every case: a run killed at a time budget keeps those done
            _write_json(json_path, so_far)
        if on_case is not None:
            on_case(so_far)
    result = _result(device, copy_gbps, cases, rows, skipped, profiles)
    if json_path is not None:
        _write_json(json_path, result)
    if plot_path is not None:
        plot_speedups(rows, plot_path)
    return result


def _result(device: torch.device, copy_gbps, cases, rows: list[dict], skipped: dict, profiles) -> dict:
    profile = {} if profiles is None else {"profile": profile_note(profiles)}
    return {
        "env": environment_info(device),
        "copy_GBps": copy_gbps,
        "cases": [asdict(c) for c in cases],
        "results": rows,
        "skipped": skipped,
        "targets": evaluate_targets(rows, device),
    } | profile


def _write_json(path: str | Path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


def plot_speedups(rows: Sequence[dict], path: str | Path) -> Path:
    """Speedup over the per-table loop vs T (log x).

    One row of panels per (B, D, L) sweep: forward on the left, fwd+bwd+update on the right;
    one line per candidate.
    """
    plt = pyplot()

    sweeps = sorted({(r["B"], r["D"], r["L"]) for r in rows})
    fig, axes = plt.subplots(
        max(1, len(sweeps)), 2, figsize=(10.0, 3.2 * max(1, len(sweeps))), squeeze=False, sharey="row"
    )
    for i, (b, d, l) in enumerate(sweeps):
        for j, label in enumerate(MODES.values()):
            ax = axes[i][j]
            sel = [r for r in rows if (r["B"], r["D"], r["L"], r["mode"]) == (b, d, l, label)]
            sel.sort(key=lambda r: r["T"])
            names = [k.removesuffix("_x") for k in (sel[0] if sel else {}) if k.endswith("_x")]
            for name in names:
                ax.plot([r["T"] for r in sel], [r[f"{name}_x"] for r in sel], marker="o", label=name)
            ax.axhline(1.0, color="grey", linewidth=0.8, label="per_table (1x)")
            ax.set_xscale("log")
            ax.set_xlabel("tables T")
            ax.set_title(f"{label}, B={b} D={d} L={l}", fontsize=9)
            if j == 0:
                ax.set_ylabel("speedup over per-table loop (x)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
