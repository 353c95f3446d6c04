"""What ``make gpu-check`` runs: its two parts, each step's budget and benchmark sizes, and the plan it prints.

A lent GPU session has 15 minutes of device time and at most 10 minutes a command, so
the check is split into two parts of under 7 minutes each on one H100 / H200 (the
ceilings, about 15 s, and the process starts included):

- ``checks`` (the default): ``pytest -m gpu``, the embedding, interaction and DCN-v2
  kernel benchmarks, host tables behind the cache (``cache_train``), meta;
- ``steps``: the training benchmarks (``bench_criteo_1hot`` and ``bench_wide`` under
  tf32 and bf16, the DCN-v2 preset) and the io reader sweep.

``--only`` names steps of either part (it overrides ``--part``); the run's limit is then
the named steps' budgets plus the same overhead, so steps of both parts together may take
longer than 7 minutes. The budgets come from the H200 run of 2026-11-26
(``bench/results/gpu/h200-2026-11-26-s12``), where the single 7-minute check killed six
of its nine steps.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

# Per step: (budget seconds on cuda, on cpu).
BUDGETS = {
    # The serial GPU suite is ~250 s of work; four processes balanced by measured seconds.
    "pytest": (120, 90),
    # 52 s on the H200 (session 15) at 30 repeats, ~13 s of it timing; now 20 repeats, and the
    # Triton candidate profiled per case (~1 s a profile): an estimate, not yet measured.
    "embedding": (65, 60),
    "interaction": (30, 60),  # 2 fp32 cases in 12 s on the H200; now 4
    "dcnv2": (18, 60),  # 13 s on the H200 (session 15)
    # train is the headline figure (two presets x two precisions; recaccel in two pipeline
    # combinations and eager; two data modes): 162 s on the H200 (session 15) with two
    # combinations and 10 steps; now three and 8.
    "train": (200, 90),
    "train_dcnv2": (50, 60),  # and the whole-step graph (sync/1/step) on it: 41 s in fp32
    "cache_train": (32, 60),  # 27 s on the H200 (session 15)
    # io: the reader worker sweep on two schemas (issue 26's rows/s targets); each schema
    # stops repeating after --max-seconds. Killed at 45 s with 0, 8, 16 workers x 3 repeats
    # (session 15), before its table: now 0 and 16 workers, 2 repeats.
    "io": (50, 60),
    "meta": (35, 60),  # 30 s on the H200 (session 15)
}
STEPS = tuple(BUDGETS)
PARTS = {
    "checks": ("pytest", "embedding", "interaction", "dcnv2", "cache_train", "meta"),
    "steps": ("train", "train_dcnv2", "io"),
}
PART_OF = {step: part for part, steps in PARTS.items() for step in steps}
DEFAULT_PART = "checks"
# The ceilings (~15 s on the H200) and the Clock's reserve on top of the steps' budgets.
OVERHEAD_S = 25
# The most one part may take on CUDA: a 15-minute loan holds the machine's start (~30 s),
# part checks (~325 s), then part steps (~325 s) with both tuning sweeps (~150 s) in one
# command; and the small mode's limit.
TOTAL_BUDGET_S = {"cuda": 330, "cpu": 300}
# Steps that run another step's benchmark at other sizes (their files are named after the step).
BENCH_OF = {"dcnv2": "interaction", "train_dcnv2": "train"}
# The train step's precision modes (issue 24 item 7's targets); the option is skipped with
# a note on a tree whose train benchmark does not offer it yet.
TRAIN_PRECISIONS = "tf32,bf16"

# recaccel's step combinations (pipeline/micro_batches/cuda_graphs) the train benchmark times:
# the overlap target's pair (sync with CUDA graphs of the head against off), and the whole
# step in one graph: the H200's sync/1/on step of bench_criteo_1hot (session 15) spent its
# first ~5 ms of each profiled step launching the preparation from the host while the
# compute stream idled. The exact overlapped step (overlap/1/off) and the other
# combinations run outside gpu-check (README: recaccel-bench train --combinations ...).
TRAIN_COMBINATIONS = "off/1/off,sync/1/on,sync/1/step"

# The benchmarks' sizes (besides --device and the output flags), by device type.
BENCH_ARGS = {
    "cuda": {
        # No T=1000 case and 20k rows per table: the benchmark draws rows and output
        # gradients on the host (T=1000 B=16384 D=128: 2 x 2.1 G randn for the gradients
        # and 3 x 1.07 G uniform for the rows, minutes on one core), which alone would
        # overrun the step's budget and leave no embedding.json. 20k rows x 26-100 tables
        # (266-512 MB) still stream from DRAM, far beyond L2.
        "embedding": [
            "--tables", "26", "--shapes", "16384:128:1",
            "--cases", "26:16384:128:20", "26:65536:128:1", "100:16384:64:20",
            "--rows", "20000", "--repeats", "20", "--batches", "2",
            # Where the module's time goes beside its kernels' (8.2 ms vs 2.6 ms at L=20 on
            # the H200, session 15): the Triton candidate's kernels and host ms per case.
            "--profile",
        ],
        # Issue 24's two shapes (B=65536 F=26 D=128, B=4096 F=500 D=32) in bf16 and tf32, padded.
        "interaction": ["--roofline-cases", "--repeats", "20"],
        # Issue 24 item 3's shape: B=16384, F=26, D=128, 3 layers, rank 512, bf16.
        "dcnv2": [
            "--kind", "dcnv2", "--batch", "16384", "--fields", "26", "--dim", "128",
            "--layers", "3", "--rank", "512", "--dtype", "bfloat16", "--repeats", "20",
        ],
        "train": [
            "--preset", "bench_criteo_1hot", "--preset", "bench_wide",
            "--steps", "8", "--warmup", "3", "--phase-steps", "2",
            # The targets read recaccel and eager; `compiled` (minutes of Inductor per
            # precision) and `reference` run outside gpu-check.
            "--candidates", "recaccel", "eager",
            "--combinations", TRAIN_COMBINATIONS, "--timeline-steps", "2",
        ],
        "train_dcnv2": [
            "--preset", "bench_dcnv2_mlperf", "--mode", "device", "--steps", "10", "--warmup", "3",
            "--phase-steps", "2", "--candidates", "recaccel", "--combinations", "off/1/off,sync/1/step",
            # bf16, as MLPerf trains it: in fp32 the 0.66 TFLOP of a step's GEMMs run on CUDA
            # cores (18 ms a step on the H200, session 15), an order short of the target.
            "--precision", "bf16",
        ],
        # 8 tables x 1M rows x 64, B=16384, Zipf 1.05, host at 10% cached vs all on the device.
        "cache_train": ["--repeats", "6", "--warmup", "1", "--batches", "8", "--no-progress"],
        # 2M criteo_1hot rows: 30 shuffle buffers, so 16 workers all decode; the wide schema
        # (500 one-hot fields) at 100k rows. No data-wait run: the data cost is train's.
        "io": [
            "--workers", "0,16", "--schema", "criteo_1hot,wide", "--rows", "2000000",
            "--wide-rows", "100000", "--repeats", "2", "--max-seconds", "4", "--train-steps", "0",
            "--cache",
        ],
        "meta": [
            "--tasks", "128", "--support", "64", "--query", "64", "--dim", "64",
            "--cardinality", "100000", "--repeats", "10", "--warmup", "2",
        ],
    },
    "cpu": {
        "embedding": [
            "--tables", "2", "--shapes", "64:8:1", "--cases", "--repeats", "2", "--batches", "1",
            "--warmup", "0", "--profile",
        ],
        "interaction": ["--batch", "32", "--fields", "3", "--dim", "8", "--repeats", "2"],
        "dcnv2": [
            "--kind", "dcnv2", "--batch", "32", "--fields", "3", "--dim", "8", "--layers", "2",
            "--rank", "4", "--repeats", "2",
        ],
        "train_dcnv2": [
            "--preset", "bench_dcnv2_mlperf", "--mode", "device", "--steps", "2", "--warmup", "1",
            "--phase-steps", "1", "--batch", "64", "--cardinality-cap", "2000", "--candidates", "recaccel",
            "--combinations", "off/1/off",
        ],
        "cache_train": [
            "--rows", "2000", "--batch", "32", "--tables", "2", "--batches", "4", "--repeats", "1",
            "--warmup", "1", "--block", "1", "--no-progress",
        ],
        "train": [
            "--preset", "bench_criteo_1hot", "--steps", "2", "--warmup", "1", "--phase-steps", "1",
            "--batch", "64", "--cardinality-cap", "2000", "--candidates", "recaccel", "eager",
            "--combinations", TRAIN_COMBINATIONS,  # the CUDA-graph ones are reported skipped on CPU
        ],
        "io": [
            "--workers", "0,1", "--schema", "criteo_1hot,wide", "--rows", "4000", "--wide-rows", "500",
            "--rows-per-row-group", "1000", "--batch-size", "256",
            "--tasks-per-batch", "4", "--support-size", "8", "--query-size", "4", "--repeats", "1",
            "--train-steps", "5", "--cache",
        ],
        "meta": [
            "--tasks", "2", "--support", "4", "--query", "4", "--repeats", "1", "--warmup", "0",
            "--no-memory", "--engines", "batched,loop", "--orders", "first",
        ],
    },
}  # fmt: skip

# The data-wait run of the io benchmark in the small mode: a tiny DLRM on tiny data.
TINY_TRAIN_CONFIG = (
    "[synth]\ntrain_rows = 2000\ntest_rows = 500\nnum_sparse = 3\ncardinality = 20\n"
    "[data]\nbatch_size = 128\n[model]\nembedding_dim = 4\nbottom_mlp = [8, 4]\ntop_mlp = [8, 1]\n"
)
# The pytest selection of the small mode (the GPU suite skips without CUDA).
CPU_PYTEST = [
    "tests/ops/test_interaction.py",
    "-k",
    "test_reference_matches_definition or test_module_and_output_dim or test_auto_is_reference_on_cpu",
]


def select_steps(part: str, only: str | None) -> tuple[str, ...]:
    """The steps of a run: those named by ``only`` (comma-separated, any part), else ``part``'s
    (``"all"``: every step), in :data:`STEPS` order."""
    if only is not None:
        named = {s.strip() for s in only.split(",") if s.strip()}
        return tuple(s for s in STEPS if s in named)
    return STEPS if part == "all" else tuple(s for s in STEPS if PART_OF[s] == part)


def unknown_steps(only: str | None) -> list[str]:
    """The names in ``only`` that are no step."""
    return [s.strip() for s in (only or "").split(",") if s.strip() and s.strip() not in STEPS]


def run_limit(steps: Sequence[str], device: str) -> float:
    """The run's overall limit: on CUDA the steps' budgets plus :data:`OVERHEAD_S`; the small mode's fixed limit."""
    if device != "cuda":
        return TOTAL_BUDGET_S["cpu"]
    return sum(BUDGETS[s][0] for s in steps) + OVERHEAD_S


def skip_reason(step: str, only: str | None) -> str:
    """Why a step did not run: another part, or not named by ``--only``."""
    return "not in --only" if only is not None else f"part {PART_OF[step]}"


def plan_text(only: Sequence[str], device: str, total_s: float, part: str | None = None) -> str:
    """The run's plan: each step to run, its budget and its command, what runs elsewhere, and the overall limit."""
    col = 0 if device == "cuda" else 1
    title = f"part {part}, " if part else ""
    lines = [f"gpu-check plan ({title}{device}): ceilings, then"]
    for name in STEPS:
        if name in only:
            bench = BENCH_OF.get(name, name)
            args = shlex.join(BENCH_ARGS[device][name]) if name in BENCH_ARGS[device] else ""
            what = "pytest -m gpu" if name == "pytest" else f"recaccel-bench {bench} {args}"
            lines.append(f"  {name:<12} {BUDGETS[name][col]:>4.0f} s  {what.strip()}")
    others = [s for s in STEPS if s not in only]
    if others:
        lines.append(f"  not in this run: {', '.join(f'{s} (part {PART_OF[s]})' for s in others)}")
    if "train" in only and device == "cuda":
        lines.append(
            "  outside gpu-check: recaccel-bench train --combinations overlap/1/off (the exact overlapped"
            " step), --candidates compiled reference"
        )
    steps_s = sum(BUDGETS[n][col] for n in STEPS if n in only)
    lines.append(f"  steps {steps_s:.0f} s; the whole run is stopped at {total_s:.0f} s")
    return "\n".join(lines)
