"""Benchmark: whole training steps, recaccel against the DLRM a user writes by hand.

``recaccel-bench train`` trains each preset's model (``configs/bench_*.toml``) with four
candidates in one run (:mod:`recaccel.bench.train_steps`): ``recaccel`` (the trainer's
step, auto backends), ``eager`` (per-table ``nn.EmbeddingBag`` + torch optimizers, as
TorchRec's unsharded modules do it; :mod:`recaccel.bench.train_eager`), ``reference``
(recaccel on its reference backends) and ``compiled`` (``eager`` with ``torch.compile``
on its dense part, reported as skipped with the reason where it cannot compile).

Before anything is timed, the eager model is checked to compute recaccel's function
(recaccel's weights copied in, equal logits); a mismatch ends the benchmark.

Data, per ``--mode``: ``device`` (a few batches of the preset's synthetic data read once,
kept on the device and rotated: no input cost) and ``reader`` (every step's batch
through the Parquet :class:`~recaccel.io.readers.rows.BatchReader` and the
:class:`~recaccel.io.loader.DeviceLoader`, the host's wait for it measured).

Each candidate runs ``--warmup`` untimed steps, ``--steps`` timed ones (CUDA events on
a GPU; the median is reported), then ``--phase-steps`` instrumented steps whose phases
are timed with the device synchronised between them (a separate pass, so the timed
steps keep their overlap). On device data the candidates' steps are timed interleaved
(one step of each per repeat, the order rotating, so drift hits all alike); through the
reader each candidate runs alone with its own reader and loader, as a real run would.
All four candidates of a preset are alive together (the presets' tables are capped so
that they fit one 80 GB GPU).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from recaccel.bench.common import (
    add_output_args,
    environment_info,
    plot_file,
    pyplot,
    save_figure,
    time_interleaved_samples,
    write_results_markdown,
)
from recaccel.bench.train_data import (
    DEFAULT_PRESETS,
    Preset,
    ReaderBatches,
    RotatingBatches,
    device_batches,
    load_preset,
    make_dataset,
    random_batch,
    rows_needed,
)
from recaccel.bench.train_eager import (
    EAGER_SPARSE_OPTIMIZERS,
    EagerDLRM,
    check_same_function,
    same_logits,
)
from recaccel.bench.train_steps import (
    CANDIDATES,
    PHASES,
    Candidate,
    PhaseTimer,
    build_candidate,
    build_recaccel_model,
)
from recaccel.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("device", "reader")
CHECK_CARDINALITY = 1000  # tables of the equivalence check's models (the function does not depend on it)
CHECK_ROWS = 256
NO_DATA_WAIT = "none (batches already on the device)"


def add_args(parser) -> None:
    """``recaccel-bench train`` options."""
    parser.add_argument(
        "--preset",
        action="append",
        help=f"a config under configs/ by name, or a config path (repeatable; default: {' '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, help="timed steps per candidate (default: 20 on CUDA, 5 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 5 on CUDA, 2 on CPU)")
    parser.add_argument(
        "--phase-steps",
        type=int,
        help="instrumented steps for the phase breakdown (default: 5 on CUDA, 2 on CPU)",
    )
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both", help="where batches come from")
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument(
        "--batch", type=int, help="batch size of every preset (default: the preset's, scaled on CPU)"
    )
    parser.add_argument(
        "--cardinality-cap", type=int, help="rows per table at most (default: the preset's, capped on CPU)"
    )
    parser.add_argument("--rotate", type=int, default=4, help="batches kept on the device in device mode")
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of the compiled candidate"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write machine-readable results here")
    add_output_args(parser, "train", plot="samples/s per candidate and the phase breakdown")


def _defaults(args, device: torch.device) -> tuple[int, int, int]:
    cuda = device.type == "cuda"
    steps = args.steps if args.steps is not None else (20 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    phase_steps = args.phase_steps if args.phase_steps is not None else (5 if cuda else 2)
    for flag, value, least in (
        ("--steps", steps, 1),
        ("--warmup", warmup, 0),
        ("--phase-steps", phase_steps, 1),
    ):
        if value < least:
            raise ConfigError(f"train bench: {flag}={value} must be >= {least}")
    for flag, value in (
        ("--batch", args.batch),
        ("--cardinality-cap", args.cardinality_cap),
        ("--rotate", args.rotate),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"train bench: {flag}={value} must be >= 1")
    return steps, warmup, phase_steps


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ equivalence


def check_preset(preset: Preset, device: torch.device, seed: int, candidates: Sequence[str]) -> str:
    """Checks, on the preset's model with small tables, that the eager baseline (and
    recaccel's auto backends) compute the reference backend's logits.

    Returns:
        A note for the report.

    Raises:
        RecaccelError: a candidate computes a different function.
    """
    synth = preset.cfg.synth
    cards = [
        min(c, CHECK_CARDINALITY) for c in (synth.cardinalities or [synth.cardinality] * synth.num_sparse)
    ]
    small = dataclasses.replace(preset.cfg, synth=dataclasses.replace(synth, cardinalities=cards))
    schema = dataclasses.replace(preset, cfg=small).schema
    torch.manual_seed(seed)
    reference = build_recaccel_model(small, schema, device, "reference")
    batch = random_batch(schema, CHECK_ROWS, synth.max_bag, seed, device)
    eager = EagerDLRM(
        schema.sparse_names, cards, schema.num_dense, small.model.bottom_mlp, small.model.top_mlp, device
    )
    eager_diff = check_same_function(eager, reference, batch, preset.name)
    note = (
        f"{preset.name}: eager computes recaccel's function: recaccel's (reference backends) initial "
        f"weights copied in, logits equal on {CHECK_ROWS} random rows (max |diff| {eager_diff:.2g}; "
        f"the preset's model with tables capped at {CHECK_CARDINALITY} rows)"
    )
    if "recaccel" in candidates:
        fast = build_recaccel_model(small, schema, device, "recaccel")
        fast.load_state_dict(reference.state_dict())
        with torch.no_grad():
            mine, theirs = fast(batch), reference(batch)
        diff = same_logits(
            mine,
            theirs,
            f"train bench {preset.name}: recaccel's auto backends disagree with its reference backends",
        )
        note += f"; recaccel (auto backends) too (max |diff| {diff:.2g})"
    del reference, eager
    _free(device)
    return note


# ------------------------------------------------------------------ measuring


def _probe(candidate: Candidate, batch) -> str | None:
    """Runs one step; for ``compiled`` a failure (torch.compile cannot build here) is the
    skip reason, for any other candidate it is raised."""
    try:
        candidate.step(batch)
    except Exception as e:  # torch.compile raises many types (BackendCompilerFailed, InductorError, ...)
        if candidate.name != "compiled":
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        return f"torch.compile failed: {type(e).__name__}: {first}"[:300]
    return None


def phase_breakdown(
    candidate: Candidate, source, device: torch.device, phase_steps: int
) -> tuple[dict, float]:
    """The instrumented pass: each phase's median ms over ``phase_steps`` steps (merged
    phases say where they went; ``data_wait`` is left to the caller), and the median
    instrumented step (ms)."""
    timer = PhaseTimer(device)
    for _ in range(phase_steps):
        batch = source.next()
        timer.start_step()
        candidate.phased_step(batch, timer)
    phases: dict[str, float | str] = {}
    for phase in PHASES:
        if phase in candidate.merged:
            phases[phase] = candidate.merged[phase]
        elif phase != "data_wait":
            phases[phase] = statistics.median(s.get(phase, 0.0) for s in timer.steps)
    return phases, statistics.median(sum(s.values()) for s in timer.steps)


def _summary(samples: list[float], waits: list[float] | None, phases: dict, instrumented: float) -> dict:
    phases["data_wait"] = statistics.fmean(waits) if waits is not None else NO_DATA_WAIT
    return {
        "step_ms": statistics.median(samples),
        "step_ms_mean": statistics.fmean(samples),
        "phases_ms": {phase: phases[phase] for phase in PHASES},
        "instrumented_step_ms": instrumented,
        "data_wait_fraction": sum(waits) / sum(samples) if waits is not None else None,
    }


def measure_on_device(
    candidates: dict[str, Candidate],
    batches: list,
    device: torch.device,
    steps: int,
    warmup: int,
    phase_steps: int,
) -> dict[str, dict]:
    """Device mode: the candidates' steps timed interleaved (one step of each per repeat,
    order rotating), then each one's instrumented pass."""
    sources = {name: RotatingBatches(batches) for name in candidates}
    calls = {name: (lambda c=c, src=sources[name]: c.step(src.next())) for name, c in candidates.items()}
    samples = time_interleaved_samples(calls, steps, warmup, device)
    out = {}
    for name, candidate in candidates.items():
        phases, instrumented = phase_breakdown(candidate, sources[name], device, phase_steps)
        out[name] = _summary(samples[name], None, phases, instrumented)
    return out


def measure_through_reader(
    candidate: Candidate,
    data: Path,
    preset: Preset,
    device: torch.device,
    steps: int,
    warmup: int,
    phase_steps: int,
) -> dict:
    """Reader mode: the candidate alone, each step's batch from a fresh BatchReader +
    DeviceLoader over ``data`` (one input pipeline, as in a real run)."""
    source = ReaderBatches(data, preset, device)
    try:
        call = {candidate.name: lambda: candidate.step(source.next())}
        samples = time_interleaved_samples(call, steps, warmup, device)[candidate.name]
        waits = source.waits_ms[-steps:]
        phases, instrumented = phase_breakdown(candidate, source, device, phase_steps)
    finally:
        source.close()
    return _summary(samples, waits, phases, instrumented)


def _row(name: str, preset: Preset, device: torch.device, mode: str) -> dict:
    return {
        "candidate": name,
        "preset": preset.name,
        "device": str(device),
        "batch": preset.batch_size,
        "mode": mode,
        "status": "ok",
        "reason": None,
        "samples_per_s": None,
        "step_ms": None,
        "phases_ms": {},
        "speedup_vs_eager": None,
    }


def build_candidates(
    preset: Preset, device: torch.device, names: Sequence[str], compile_backend: str, seed: int, batch
) -> tuple[dict[str, Candidate], dict[str, str]]:
    """Builds every candidate and runs one step of each on ``batch``; returns those that
    ran and, by name, the reason of those skipped (``compiled`` where torch.compile fails)."""
    built, skipped = {}, {}
    for name in names:
        torch.manual_seed(seed)
        candidate = build_candidate(name, preset.cfg, preset.schema, device, compile_backend)
        reason = _probe(candidate, batch)
        if reason is None:
            built[name] = candidate
        else:
            skipped[name] = reason
            del candidate
            torch._dynamo.reset()  # drops the failed graphs and the model they hold
    return built, skipped


def bench_preset(
    preset: Preset,
    device: torch.device,
    *,
    modes: Sequence[str],
    candidates: Sequence[str],
    steps: int,
    warmup: int,
    phase_steps: int,
    rotate: int,
    compile_backend: str,
    seed: int,
    work: Path,
    bar: tqdm,
) -> tuple[list[dict], list[str]]:
    """Every candidate on one preset, in every mode; returns result rows and notes."""
    batches = max(rotate, warmup + steps + phase_steps if "reader" in modes else 0)
    data = make_dataset(preset, rows_needed(preset.batch_size, batches), work / preset.name)
    notes = [check_preset(preset, device, seed, candidates)]
    on_device = device_batches(data, preset, rotate, device)
    bar.set_description(f"{preset.name}: building")
    built, skipped = build_candidates(preset, device, candidates, compile_backend, seed, on_device[0])
    results = {}
    if "device" in modes:
        bar.set_description(f"{preset.name}: device data")
        results["device"] = measure_on_device(built, on_device, device, steps, warmup, phase_steps)
    del on_device
    rows = []
    for name in candidates:
        bar.set_description(f"{preset.name}: {name}")
        if "reader" in modes and name in built:
            results.setdefault("reader", {})[name] = measure_through_reader(
                built[name], data, preset, device, steps, warmup, phase_steps
            )
        for mode in modes:
            row = _row(name, preset, device, mode)
            if name in skipped:
                row.update(status="skipped", reason=skipped[name])
            else:
                row.update(results[mode][name])
                row["samples_per_s"] = preset.batch_size / (row["step_ms"] * 1e-3)
            rows.append(row)
        bar.update(1)
    notes += [n for c in built.values() for n in c.notes]
    notes += [f"{preset.name}: {name} skipped: {reason}" for name, reason in skipped.items()]
    del built
    torch._dynamo.reset()
    _free(device)
    return rows, notes


def speedups(rows: list[dict]) -> None:
    """Sets ``speedup_vs_eager``: eager's step time over the candidate's, same preset and mode."""
    eager = {
        (r["preset"], r["mode"]): r["step_ms"] for r in rows if r["candidate"] == "eager" and r["step_ms"]
    }
    for r in rows:
        base = eager.get((r["preset"], r["mode"]))
        r["speedup_vs_eager"] = base / r["step_ms"] if base and r["step_ms"] else None


def run_train_bench(args) -> tuple[list[dict], list[str], dict]:
    """Runs every preset; returns result rows, notes and the environment."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train bench: --device {args.device} but no CUDA device is available")
    steps, warmup, phase_steps = _defaults(args, device)
    modes = MODES if args.mode == "both" else (args.mode,)
    presets = [
        load_preset(name, device, batch=args.batch, cardinality_cap=args.cardinality_cap)
        for name in (args.preset or DEFAULT_PRESETS)
    ]
    rows, notes = [], []
    with (
        tempfile.TemporaryDirectory(prefix="recaccel-bench-train-") as tmp,
        tqdm(total=len(presets) * len(args.candidates), unit="candidate", disable=None) as bar,
    ):
        for preset in presets:
            what = f"{preset.name}: {preset.schema.num_sparse} tables, D={preset.cfg.model.embedding_dim}, "
            what += f"batch {preset.batch_size}" + (
                f"; scaled for {device.type}: " + "; ".join(preset.scaled) if preset.scaled else ""
            )
            notes.append(what)
            found, said = bench_preset(
                preset,
                device,
                modes=modes,
                candidates=args.candidates,
                steps=steps,
                warmup=warmup,
                phase_steps=phase_steps,
                rotate=args.rotate,
                compile_backend=args.compile_backend,
                seed=args.seed,
                work=Path(tmp),
                bar=bar,
            )
            rows += found
            notes += said
            if getattr(args, "json", None):
                # Each preset's rows as soon as it ends: a run killed at its time budget
                # (make gpu-check) still leaves the presets it finished.
                speedups(rows)
                _write_json(args.json, environment_info(device), rows, notes)
    speedups(rows)
    notes = list(dict.fromkeys(notes))  # a candidate's description repeats per preset
    sparse = {p.cfg.optim.sparse for p in presets}
    notes += [
        f"timing: {warmup} warm-up steps, then the median of {steps} timed steps "
        + ("(CUDA events)" if device.type == "cuda" else "(perf_counter)")
        + "; samples_per_s = batch / median step time; device mode times the candidates interleaved "
        "(one step of each per repeat, order rotating), reader mode one candidate after another.",
        f"phases: median of {phase_steps} instrumented steps with the device synchronised between phases "
        "(a separate pass: the sum, instrumented_step_ms, exceeds step_ms by the lost overlap); "
        "mlps = bottom MLP + top MLP + loss; a phase a candidate does not run on its own says what it is part of.",
        "device mode: batches of the preset's synthetic data read once and rotated on the device; reader mode: "
        "BatchReader (Parquet) + DeviceLoader per step, data_wait = mean host time blocked on the next batch "
        "over the timed steps, data_wait_fraction = total wait / total step time.",
        "eager's sparse optimizer: "
        + "; ".join(f"optim.sparse={s} -> {EAGER_SPARSE_OPTIMIZERS[s]}" for s in sorted(sparse))
        + "; its dense optimizer is recaccel's (optim.dense).",
    ]
    env = environment_info(device)
    return rows, notes, env


# ------------------------------------------------------------------ reporting


_SHORT = {
    "embedding_forward": "emb_fwd",
    "interaction": "interaction",
    "mlps": "mlps",
    "backward": "backward",
    "sparse_update": "sparse_upd",
    "dense_optimizer": "dense_opt",
    "data_wait": "data_wait",
}


def table_rows(rows: list[dict]) -> list[dict]:
    """Result rows flattened for the markdown table (phases as ``<phase>_ms`` columns)."""
    out = []
    for r in rows:
        flat = {k: r[k] for k in ("preset", "mode", "candidate", "batch", "samples_per_s", "step_ms")}
        flat["speedup_vs_eager"] = r["speedup_vs_eager"]
        for phase in PHASES:
            value = r["phases_ms"].get(phase)
            if isinstance(value, str):
                value = "merged" if value.startswith("merged") else "-"
            flat[f"{_SHORT[phase]}_ms"] = value
        flat["data_wait_frac"] = r.get("data_wait_fraction")
        if r["status"] != "ok":
            flat["candidate"] = f"{r['candidate']} (skipped)"
        out.append(flat)
    return out


def plot_results(rows: list[dict], path: str | Path) -> Path:
    """Samples/s per candidate for each preset and mode (left), stacked phases (right)."""
    plt = pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    groups = list(dict.fromkeys((r["preset"], r["mode"]) for r in ok))
    names = list(dict.fromkeys(r["candidate"] for r in ok))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 2.2 * len(groups) + 6), 6.0))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        values = {(r["preset"], r["mode"]): r["samples_per_s"] for r in ok if r["candidate"] == name}
        left.bar(
            [g + k * width for g in range(len(groups))],
            [values.get(g, 0.0) for g in groups],
            width,
            label=name,
        )
    left.set_xticks(
        [g + 0.4 - width / 2 for g in range(len(groups))], [f"{p}\n{m}" for p, m in groups], fontsize=7
    )
    left.set_yscale("log")  # presets differ by orders of magnitude
    left.set_ylabel("samples / s (log scale)")
    left.set_title("Training throughput")
    left.legend(fontsize=7)
    labels = [f"{r['preset']} {r['mode']} {r['candidate']}" for r in ok]
    bottom = [0.0] * len(ok)
    for phase in PHASES:
        values = [v if isinstance(v := r["phases_ms"].get(phase), float) else 0.0 for r in ok]
        right.bar(range(len(ok)), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(range(len(ok)), labels, fontsize=6, rotation=90)
    right.set_ylabel("ms per step (instrumented)")
    right.set_title("Phases (device synchronised between phases)")
    right.legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def _write_json(path: str | Path, env: dict, rows: list[dict], notes: list[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"env": env, "results": rows, "notes": notes}, indent=2))


def main(args, command_line: str) -> Path:
    """Runs the benchmark; writes markdown, optionally JSON and a plot; returns the markdown path."""
    rows, notes, env = run_train_bench(args)
    if args.json:
        _write_json(args.json, env, rows, notes)
    plot = plot_file(args)
    if plot is not None:
        plot_results(rows, plot)
    return write_results_markdown(
        args.out,
        "Training steps: recaccel vs hand-written PyTorch",
        env,
        command_line,
        table_rows(rows),
        notes,
    )
