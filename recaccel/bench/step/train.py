"""Benchmark: whole training steps, recaccel against the DLRM a user writes by hand.

``recaccel-bench train`` trains each preset's model (``configs/bench_*.toml``) with four
candidates in one run (:mod:`recaccel.bench.step.candidates`): ``recaccel`` (the trainer's
step, auto backends), ``eager`` (per-table ``nn.EmbeddingBag`` + torch optimizers, as
TorchRec's unsharded modules do it; :mod:`recaccel.bench.step.eager`), ``reference``
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

``--precision fp32,tf32,bf16`` times every candidate under each ``train.precision`` mode
in turn, all under the same setting (a fair baseline): the mode's TF32 switch
(:func:`~recaccel.train.model.precision.matmul_precision`) over the mode's whole pass, and
under ``bf16`` autocast around each candidate's dense forward; rows carry
``"precision"`` and speedups compare rows of one mode. Off CUDA ``tf32`` runs as
``fp32`` (a note says so). Without it each preset runs its own ``train.precision``.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, plot_file, write_results_markdown
from recaccel.bench.step.candidates import (
    CANDIDATES,
    PRECISIONS,
    Candidate,
    Combination,
    build_candidates,
    parse_combinations,
    parse_precisions,
    with_precision,
)
from recaccel.bench.step.check import check_preset, free_memory
from recaccel.bench.step.data import (
    DEFAULT_PRESETS,
    Preset,
    device_batches,
    load_preset,
    make_dataset,
    rows_needed,
)
from recaccel.bench.step.measure import Timing, measure_on_device, measure_through_reader
from recaccel.bench.step.phased import dense_head_tflops
from recaccel.bench.step.report import (
    combinations_section,
    cpu_target_note,
    method_notes,
    plot_results,
    precision_notes,
    precision_timeline,
    speedups,
    table_rows,
    timeline_path,
    write_json,
)
from recaccel.bench.step.timeline import draw_timeline
from recaccel.config import Precision
from recaccel.errors import ConfigError
from recaccel.train.loop.pipeline import batch_tensors
from recaccel.train.model.precision import matmul_precision

log = logging.getLogger(__name__)

MODES = ("device", "reader")


def add_args(parser) -> None:
    """``recaccel-bench train`` options."""
    parser.add_argument(
        "--preset",
        action="append",
        help=f"a config under configs/ by name, or a config path (repeatable; default: {' '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if present)",
    )
    parser.add_argument("--steps", type=int, help="timed steps per candidate (default: 20 on CUDA, 5 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 5 on CUDA, 2 on CPU)")
    parser.add_argument(
        "--phase-steps",
        type=int,
        help="instrumented steps for the phase breakdown (default: 5 on CUDA, 2 on CPU)",
    )
    parser.add_argument(
        "--block",
        type=int,
        help="consecutive steps per timed sample, so a pipeline overlaps its own steps "
        "(default: 5 on CUDA, 1 on CPU)",
    )
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both", help="where batches come from")
    parser.add_argument(
        "--candidates",
        nargs="+",
        choices=CANDIDATES,
        default=list(CANDIDATES),
        help="the training loops timed",
    )
    parser.add_argument(
        "--pipeline",
        default="off",
        help="train.pipeline values the recaccel candidate is timed under, comma-separated (off,sync,semi_sync,overlap)",
    )
    parser.add_argument(
        "--micro-batches", default="1", help="train.micro_batches values, comma-separated (e.g. 1,2,4)"
    )
    parser.add_argument(
        "--cuda-graphs",
        default="off",
        help="CUDA graphs, comma-separated: off, on (the dense head), step (the whole step)",
    )
    parser.add_argument(
        "--combinations",
        help="pipeline/micro_batches/graphs labels, comma-separated (sync/2/on,...), instead of the three lists",
    )
    parser.add_argument(
        "--timeline-steps",
        type=int,
        default=3,
        help="profiled steps of the timeline picture of a sync combination (0: none)",
    )
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
    parser.add_argument(
        "--precision",
        help="train.precision modes every candidate is timed under, comma-separated (fp32,tf32,bf16; "
        "default: each preset's own)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model")
    parser.add_argument("--json", help="write machine-readable results here")
    add_output_args(parser, "train", plot="samples/s per candidate and the phase breakdown")


def _defaults(args, device: torch.device) -> Timing:
    cuda = device.type == "cuda"
    steps = args.steps if args.steps is not None else (20 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    phase_steps = args.phase_steps if args.phase_steps is not None else (5 if cuda else 2)
    block = args.block if args.block is not None else (5 if cuda else 1)
    timeline = getattr(args, "timeline_steps", 0)
    for flag, value, least in (
        ("--steps", steps, 1),
        ("--warmup", warmup, 0),
        ("--phase-steps", phase_steps, 1),
        ("--block", block, 1),
        ("--timeline-steps", timeline, 0),
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
    return Timing(steps, warmup, phase_steps, min(block, steps), timeline)


# ------------------------------------------------------------------ equivalence


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


@dataclass
class Entry:
    """One row-to-be of a preset: a candidate (or a combination of it) and what became of it."""

    name: str
    combination: Combination | None
    candidate: Candidate | None = None
    reason: str | None = None

    @property
    def key(self) -> str:
        if self.candidate is not None:
            return self.candidate.key
        return self.name if self.combination is None else f"{self.name} {self.combination.label}"


def _row(entry: Entry, preset: Preset, device: torch.device, mode: str) -> dict:
    combination = entry.combination
    return {
        "candidate": entry.name,
        "preset": preset.name,
        "device": str(device),
        "batch": preset.batch_size,
        "mode": mode,
        "precision": preset.cfg.train.precision,
        "pipeline": combination.pipeline if combination else None,
        "micro_batches": combination.micro_batches if combination else None,
        "cuda_graphs": combination.cuda_graphs if combination else None,
        "status": "ok",
        "reason": None,
        "samples_per_s": None,
        "step_ms": None,
        "phases_ms": {},
        "speedup_vs_eager": None,
        "speedup_vs_off": None,
    }


def build_entries(
    preset: Preset,
    device: torch.device,
    names: Sequence[str],
    combinations: Sequence[Combination],
    compile_backend: str,
    seed: int,
    batch,
) -> list[Entry]:
    """Builds every candidate (every combination of ``recaccel``) and runs one step of
    each on ``batch``; an entry without a candidate carries the one-line reason it was
    skipped (a combination the device cannot run; ``compiled`` where torch.compile fails)."""
    entries = []
    for name in names:
        torch.manual_seed(seed)
        built, refused = build_candidates(
            name, preset.cfg, preset.schema, device, compile_backend, combinations
        )
        entries += [Entry(name, combination, reason=reason) for combination, reason in refused.items()]
        failed = False
        for candidate in built:
            reason = _probe(candidate, batch)
            entries.append(Entry(name, candidate.combination, None if reason else candidate, reason))
            failed = failed or reason is not None
        if failed:
            del built, candidate
            torch._dynamo.reset()  # drops the failed graphs and the model they hold
    order = {c: k for k, c in enumerate(combinations)}
    entries.sort(key=lambda e: (names.index(e.name), order.get(e.combination, -1)))
    return entries


def _timeline_candidate(entries: list[Entry]) -> Candidate | None:
    """The sync combination the timeline profiles (one micro-batch first, graphs on first)."""
    synced = [
        e.candidate
        for e in entries
        if e.candidate is not None and e.name == "recaccel" and e.combination.pipeline == "sync"
    ]
    synced.sort(key=lambda c: (c.combination.micro_batches != 1, c.combination.cuda_graphs != "on"))
    return synced[0] if synced else None


def bench_preset(
    preset: Preset,
    device: torch.device,
    *,
    modes: Sequence[str],
    candidates: Sequence[str],
    combinations: Sequence[Combination],
    timing: Timing,
    rotate: int,
    compile_backend: str,
    seed: int,
    work: Path,
    timeline: Path | None,
    bar: tqdm,
    precisions: Sequence[Precision] | None = None,
) -> tuple[list[dict], list[str]]:
    """Every candidate on one preset, in every mode, under every precision mode (None:
    the preset's own ``train.precision``), and the timeline of a sync step; returns
    result rows and notes. The data and the equivalence check are shared by the modes."""
    batches = max(rotate, timing.batches_per_run if "reader" in modes else 0)
    batches = max(batches, timing.timeline_steps + 3)
    data = make_dataset(preset, rows_needed(preset.batch_size, batches), work / preset.name)
    notes = [check_preset(preset, device, seed, candidates)]
    on_device = device_batches(data, preset, rotate, device)
    precisions = list(precisions or [preset.cfg.train.precision])
    rows = []
    for precision in precisions:
        run = dataclasses.replace(preset, cfg=with_precision(preset.cfg, precision))
        picture = (
            timeline if timeline is None or len(precisions) == 1 else precision_timeline(timeline, precision)
        )
        with matmul_precision(precision):  # every candidate under the same TF32 switch
            found, said = bench_precision(
                run,
                device,
                data,
                on_device,
                modes=modes,
                candidates=candidates,
                combinations=combinations,
                timing=timing,
                compile_backend=compile_backend,
                seed=seed,
                timeline=picture,
                bar=bar,
            )
        rows += found
        notes += said
    del on_device
    return rows, notes


def bench_precision(
    preset: Preset,
    device: torch.device,
    data: Path,
    on_device: list,
    *,
    modes: Sequence[str],
    candidates: Sequence[str],
    combinations: Sequence[Combination],
    timing: Timing,
    compile_backend: str,
    seed: int,
    timeline: Path | None,
    bar: tqdm,
) -> tuple[list[dict], list[str]]:
    """Every candidate on one preset under its ``train.precision`` (the caller sets the
    TF32 switch), in every mode, and the timeline of a sync step; returns result rows
    and notes."""
    precision = preset.cfg.train.precision
    bar.set_description(f"{preset.name} {precision}: building")
    input_mb = sum(t.numel() * t.element_size() for t in batch_tensors(on_device[0])) / 2**20
    entries = build_entries(preset, device, candidates, combinations, compile_backend, seed, on_device[0])
    built = {e.key: e.candidate for e in entries if e.candidate is not None}
    results = {}
    if "device" in modes:
        bar.set_description(f"{preset.name} {precision}: device data")
        results["device"] = measure_on_device(built, on_device, device, timing)
    rows = []
    for entry in entries:
        bar.set_description(f"{preset.name} {precision}: {entry.key}")
        if "reader" in modes and entry.candidate is not None:
            results.setdefault("reader", {})[entry.key] = measure_through_reader(
                entry.candidate, data, preset, device, timing
            )
        for mode in modes:
            row = _row(entry, preset, device, mode)
            row["batch_input_mb"] = input_mb
            if entry.candidate is None:
                row.update(status="skipped", reason=entry.reason)
            else:
                row.update(results[mode][entry.key])
                row["samples_per_s"] = preset.batch_size / (row["step_ms"] * 1e-3)
                tflops = dense_head_tflops(row["phases_ms"], entry.candidate.head_flops, preset.batch_size)
                if tflops is not None:
                    row["dense_head_TFLOPs"] = tflops
            rows.append(row)
        bar.update(1)
    chosen = _timeline_candidate(entries)
    notes = []
    if timeline is not None and timing.timeline_steps and chosen is not None:
        bar.set_description(f"{preset.name} {precision}: timeline")
        notes.append(
            draw_timeline(
                chosen, preset, data if "reader" in modes else on_device, timing.timeline_steps, timeline
            )
        )
    notes += list(dict.fromkeys(n for e in entries if e.candidate for n in e.candidate.notes))
    notes += [
        f"{preset.name} ({precision}): {e.key} skipped: {e.reason}" for e in entries if e.candidate is None
    ]
    del built, entries, chosen
    torch._dynamo.reset()
    free_memory(device)
    return rows, notes


def run_train_bench(args) -> tuple[list[dict], list[str], dict]:
    """Runs every preset; returns result rows, notes and the environment."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train bench: --device {args.device} but no CUDA device is available")
    timing = _defaults(args, device)
    combinations = parse_combinations(
        args.pipeline, args.micro_batches, args.cuda_graphs, getattr(args, "combinations", None)
    )
    precisions = parse_precisions(getattr(args, "precision", None))
    modes = MODES if args.mode == "both" else (args.mode,)
    presets = [
        load_preset(name, device, batch=args.batch, cardinality_cap=args.cardinality_cap)
        for name in (args.preset or DEFAULT_PRESETS)
    ]
    rows, notes = [], []
    per_preset = sum(len(combinations) if name == "recaccel" else 1 for name in args.candidates)
    per_preset *= len(precisions or [None])
    with (
        tempfile.TemporaryDirectory(prefix="recaccel-bench-train-") as tmp,
        tqdm(total=len(presets) * per_preset, unit="candidate", disable=None) as bar,
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
                combinations=combinations,
                timing=timing,
                rotate=args.rotate,
                compile_backend=args.compile_backend,
                seed=args.seed,
                work=Path(tmp),
                timeline=timeline_path(args.out, preset.name) if getattr(args, "plot", None) != "" else None,
                bar=bar,
                precisions=precisions,
            )
            rows += found
            notes += said
            if getattr(args, "json", None):
                # Each preset's rows as soon as it ends: a run killed at its time budget
                # (make gpu-check) still leaves the presets it finished.
                speedups(rows)
                write_json(args.json, environment_info(device), rows, notes)
    speedups(rows)
    notes = list(dict.fromkeys(notes))  # a candidate's description repeats per preset
    if device.type == "cpu":
        notes.append(cpu_target_note(rows))
    notes += method_notes(presets, timing, device, combinations)
    notes += precision_notes(sorted({r["precision"] for r in rows}, key=PRECISIONS.index), device)
    env = environment_info(device)
    return rows, notes, env


# ------------------------------------------------------------------ reporting


def main(args, command_line: str) -> Path:
    """Runs the benchmark; writes markdown, optionally JSON and a plot; returns the markdown path."""
    rows, notes, env = run_train_bench(args)
    if args.json:
        write_json(args.json, env, rows, notes)
    plot = plot_file(args)
    if plot is not None:
        plot_results(rows, plot)
    path = write_results_markdown(
        args.out,
        "Training steps: recaccel vs hand-written PyTorch",
        env,
        command_line,
        table_rows(rows),
        notes,
    )
    with open(path, "a") as f:
        f.write(combinations_section(rows, Path(args.out)))
    return path
