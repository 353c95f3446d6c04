"""``make gpu-check``: verify and measure everything on a lent GPU, in one command.

``python -m recaccel.bench.gpu_check --device cuda --out DIR`` (the tree run as
``PYTHONPATH=.``), within 7 minutes on one H100 / H200 (the plan, each step with its
budget, is printed first; the kernel tuning run ``recaccel-bench kernels`` fits beside it
in a 15-minute loan):

1. environment (``nvidia-smi``, torch, Triton, device) and the two ceilings of this run:
   device-to-device copy bandwidth (bytes read + written, median) and the bf16 matmul
   rate (8192^3, random data);
2. ``pytest -m gpu``: the files marking GPU tests in four groups run as pytest processes
   at once (:mod:`~recaccel.bench.gpu_check.pytest_groups`; the lent machines have no
   pytest-xdist), their logs joined in ``DIR/pytest.txt``;
3. every ``recaccel-bench`` benchmark at GPU sizes, each a subprocess writing markdown,
   JSON and plots (a benchmark not registered yet is skipped with a line): embedding,
   dot interaction, DCN-v2 cross network (bf16), training under tf32 and bf16 on
   ``bench_criteo_1hot`` and ``bench_wide``, the DCN-v2 preset, host tables behind the
   cache (``cache_train``), io (rows/s per reader worker count on the criteo_1hot and
   wide schemas), meta;
4. a closing summary printed last: steps, pytest's line, each GPU target with its
   figure and met / not met / not measured (:mod:`recaccel.bench.gpu_check.targets`).

Every subprocess step has a time budget; one that overruns is killed (its whole
process group) and reported, and the rest still run. ``--device cpu`` is the small
mode: the same steps at tiny sizes in well under a minute, with a fast pytest selection
instead of the GPU suite (which skips without CUDA), CPU copies and an fp32 matmul for
the ceilings. Files left in ``DIR``: :mod:`recaccel.bench.gpu_check.report`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch

from recaccel.bench.gpu_check import report as report_files
from recaccel.bench.gpu_check.gpu_tests import gpu_test_files
from recaccel.bench.gpu_check.pytest_groups import balance, join_logs, run_groups, sum_summaries
from recaccel.bench.gpu_check.targets import evaluate
from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.timing import measure_copy_bandwidth, time_interleaved

REPO = Path(__file__).resolve().parents[3]
BENCH_ENTRY = "import sys; from recaccel.cli import bench_main; sys.exit(bench_main())"
# Under 7 minutes on CUDA with the ceilings (~15 s) and process starts: the steps' budgets
# sum to 409 s.
TOTAL_BUDGET_S = {"cuda": 419, "cpu": 300}

# Per step: (budget seconds on cuda, on cpu).
BUDGETS = {
    # train is the headline figure (two presets x two precisions; recaccel in two pipeline
    # combinations and eager; two data modes): the largest share after the test suite.
    "pytest": (90, 90),
    "embedding": (45, 60),
    "interaction": (15, 60),
    "dcnv2": (15, 60),
    "train": (120, 90),
    "train_dcnv2": (35, 60),
    "cache_train": (40, 60),
    # io: the reader worker sweep on two schemas (issue 26's rows/s targets); each schema
    # stops repeating after --max-seconds.
    "io": (29, 60),
    "meta": (20, 60),
}
STEPS = tuple(BUDGETS)
# Steps that run another step's benchmark at other sizes (their files are named after the step).
BENCH_OF = {"dcnv2": "interaction", "train_dcnv2": "train"}
# The train step's precision modes (issue 24 item 7's targets); the option is skipped with
# a note on a tree whose train benchmark does not offer it yet.
TRAIN_PRECISIONS = "tf32,bf16"

# recaccel's step combinations (pipeline/micro_batches/cuda_graphs) the train benchmark times:
# the overlap target's pair (sync with CUDA graphs against off) and the exact overlapped step
# (train.pipeline=overlap). The other combinations run outside gpu-check (README:
# recaccel-bench train --combinations ...).
TRAIN_COMBINATIONS = "off/1/off,sync/1/on,overlap/1/off"

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
            "--rows", "20000", "--repeats", "30", "--batches", "2",
        ],
        "interaction": ["--batch", "16384", "65536", "--fields", "26", "--dim", "128", "--repeats", "30"],
        # Issue 24 item 3's shape: B=16384, F=26, D=128, 3 layers, rank 512, bf16.
        "dcnv2": [
            "--kind", "dcnv2", "--batch", "16384", "--fields", "26", "--dim", "128",
            "--layers", "3", "--rank", "512", "--dtype", "bfloat16", "--repeats", "20",
        ],
        "train": [
            "--preset", "bench_criteo_1hot", "--preset", "bench_wide",
            "--steps", "10", "--warmup", "3", "--phase-steps", "2",
            # The targets read recaccel and eager; `compiled` (minutes of Inductor per
            # precision) and `reference` run outside gpu-check.
            "--candidates", "recaccel", "eager",
            "--combinations", TRAIN_COMBINATIONS, "--timeline-steps", "2",
        ],
        "train_dcnv2": [
            "--preset", "bench_dcnv2_mlperf", "--mode", "device", "--steps", "10", "--warmup", "3",
            "--phase-steps", "2", "--candidates", "recaccel", "--combinations", "off/1/off",
        ],
        # 8 tables x 1M rows x 64, B=16384, Zipf 1.05, host at 10% cached vs all on the device.
        "cache_train": ["--repeats", "6", "--warmup", "1", "--batches", "8", "--no-progress"],
        # 2M criteo_1hot rows: 30 shuffle buffers, so 16 workers all decode; the wide schema
        # (500 one-hot fields) at 100k rows. No data-wait run: the data cost is train's.
        "io": [
            "--workers", "0,8,16", "--schema", "criteo_1hot,wide", "--rows", "2000000",
            "--wide-rows", "100000", "--repeats", "3", "--max-seconds", "6", "--train-steps", "0",
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
            "--warmup", "0",
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


@dataclass
class StepResult:
    """What one step did."""

    name: str
    status: str  # ok | failed | timeout | skipped
    budget_s: float | None = None
    seconds: float = 0.0
    rc: int | None = None
    command: str = ""
    note: str = ""
    tail: str = ""
    files: list[str] = field(default_factory=list)


def run_step(
    argv: Sequence[str], log: Path, timeout_s: float, env: dict[str, str]
) -> tuple[str, int | None, float]:
    """Runs ``argv`` in the repository root, stdout and stderr into ``log``, for at most ``timeout_s``.

    The child leads its own process group; on timeout the whole group (the child and
    whatever it started) is killed.

    Returns:
        (``"ok"`` | ``"failed"`` | ``"timeout"``, exit code or None when killed, seconds).
    """
    t0 = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            list(argv), cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", None, time.monotonic() - t0
    return ("ok" if rc == 0 else "failed"), rc, time.monotonic() - t0


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _child_env(keep_triton_interpret: bool) -> dict[str, str]:
    """The environment of a step: this one, the repository on PYTHONPATH, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if not keep_triton_interpret:
        env.pop("TRITON_INTERPRET", None)  # benchmarks time Triton on CUDA only, never interpreted
    return env


def nvidia_smi_line() -> str:
    """One line from ``nvidia-smi`` (name, driver, memory, clocks, power), or why there is none."""
    query = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi unavailable ({type(e).__name__})"
    return (out.stdout.strip() or out.stderr.strip()).replace("\n", " / ")


def measure_matmul_tflops(
    device: torch.device, n: int, dtype: torch.dtype, repeats: int, warmup: int
) -> float:
    """Rate of an ``n x n x n`` matrix product on random data (never zeros), TFLOP/s, median."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    ms = time_interleaved({"mm": lambda: torch.matmul(a, b, out=out)}, repeats, warmup, device)["mm"]
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_ceilings(device: torch.device) -> dict:
    """This run's copy bandwidth and matmul rate (bf16 8192^3 on CUDA, fp32 512^3 on CPU)."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    out: dict = {"matmul": f"{str(dtype).removeprefix('torch.')} {n}^3", "errors": []}
    try:
        nbytes = 2**30 if cuda else 2**25
        out["copy_GBps"] = measure_copy_bandwidth(device, nbytes, repeats=20 if cuda else 5)
        out["copy_bytes"] = nbytes
    except (RuntimeError, MemoryError) as e:
        out["errors"].append(f"copy bandwidth: {type(e).__name__}: {e}")
    try:
        out["matmul_TFLOPs"] = measure_matmul_tflops(device, n, dtype, 20 if cuda else 5, 3 if cuda else 1)
    except (RuntimeError, MemoryError) as e:
        out["errors"].append(f"matmul: {type(e).__name__}: {e}")
    if cuda:
        torch.cuda.empty_cache()  # leave the memory to the steps' processes
    return out


def _bench_options(name: str) -> set[str] | None:
    """The option strings ``recaccel-bench name`` accepts, or None when it is not registered."""
    from recaccel.bench.harness.registry import BENCHMARKS

    if name not in BENCHMARKS:
        return None
    parser = argparse.ArgumentParser()
    BENCHMARKS[name][1](parser)
    return set(parser._option_string_actions)  # argparse keeps no public list of a parser's flags


def bench_argv(name: str, device: str, parts: Path, options: set[str], plots: bool) -> list[str]:
    """``recaccel-bench`` arguments of one step: its benchmark, sizes, device, and outputs
    into ``parts`` (named after the step)."""
    bench = BENCH_OF.get(name, name)
    argv = [bench, *BENCH_ARGS[device][name], "--device", device, "--out", str(parts / f"{name}.md")]
    if name == "train" and device == "cuda" and "--precision" in options:
        argv += ["--precision", TRAIN_PRECISIONS]
    if device == "cpu" and name == "io":
        config = parts / "io_tiny_train.toml"
        config.write_text(TINY_TRAIN_CONFIG)
        argv += ["--train-config", str(config)]
    if "--json" in options:
        argv += ["--json", str(parts / f"{name}.json")]
    if "--plot" in options:
        argv += ["--plot", str(parts / f"{name}.png") if plots else ""]
    return argv


def pytest_groups(device: str) -> list[list[str]]:
    """The pytest processes of the step, run at once (:mod:`~recaccel.bench.gpu_check.pytest_groups`):
    the GPU suite's files in up to four groups on CUDA; a fast selection in the small mode."""
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    if device != "cuda":
        return [[*base, "-q", *CPU_PYTEST]]
    # The GPU tests are independent: four processes share the GPU (Triton's compiles, the
    # larger part of the serial suite's time, run on four cores). -v names each test as it
    # ends: a group killed at the budget shows where it was.
    groups = max(1, min(4, (os.cpu_count() or 1) // 4))
    files = balance(gpu_test_files(REPO / "tests", REPO), groups)
    options = ["-v", "-m", "gpu", "--continue-on-collection-errors", "--durations=5"]
    return [[*base, *options, *group] for group in files]


class Clock:
    """The run's overall deadline; each step gets its budget or what is left, whichever is less."""

    def __init__(self, total_s: float, reserve_s: float = 10.0) -> None:
        self.total_s = total_s
        self.deadline = time.monotonic() + total_s
        self.reserve_s = reserve_s

    def allowance(self, budget_s: float) -> float:
        return min(budget_s, self.deadline - time.monotonic() - self.reserve_s)


def _run_pytest(device: str, out: Path, clock: Clock, budget_s: float) -> tuple[StepResult, dict]:
    if not (REPO / "tests").is_dir():
        return StepResult("pytest", "skipped", budget_s, note=f"no tests/ in {REPO}"), {"command": ""}
    argvs = pytest_groups(device)
    command = " & ".join(shlex.join(["python", *argv[1:]]) for argv in argvs)
    allowed = clock.allowance(budget_s)
    if allowed < 5:
        return StepResult("pytest", "skipped", budget_s, note="no time left"), {"command": command}
    logs = [out / f"pytest_group{i}.txt" for i in range(len(argvs))]
    t0 = time.monotonic()
    ended = run_groups(argvs, logs, allowed, _child_env(keep_triton_interpret=True), REPO)
    seconds = time.monotonic() - t0
    text = join_logs(argvs, logs, ended, out / report_files.PYTEST_LOG)
    summary = sum_summaries(
        [report_files.pytest_summary(log.read_text(errors="replace")) for log in logs], seconds
    )
    for log in logs:
        log.unlink(missing_ok=True)  # joined into pytest.txt
    killed = [argv for argv, e in zip(argvs, ended) if e.status == "timeout"]
    status = "timeout" if killed else "failed" if any(e.status == "failed" for e in ended) else "ok"
    if killed:
        files = [a for argv in killed for a in argv if a.endswith(".py")]
        rest = shlex.join(["python", "-m", "pytest", "-m", "gpu", *files])
        summary = f"killed after {seconds:.0f} s (budget {allowed:.0f} s); so far: {summary or '-'}; the rest: {rest}"
    rc = max((e.rc for e in ended if e.rc not in (None, 0, 5)), default=None if killed else 0)
    info = {"command": command, "summary": summary, "failures": report_files.pytest_failures(text), "rc": rc}
    step = StepResult(
        "pytest", status, round(allowed), seconds, rc, command, summary, "\n".join(text.splitlines()[-15:])
    )
    return step, info


def _step_note(name: str, device: str, options: set[str]) -> str:
    """What a step leaves out on this tree (the train benchmark's precision modes)."""
    if name == "train" and device == "cuda" and "--precision" not in options:
        return f"recaccel-bench train has no --precision here: ran each preset's own precision, not {TRAIN_PRECISIONS}"
    return ""


def _run_bench(name: str, device: str, parts: Path, clock: Clock, budget_s: float, plots: bool) -> StepResult:
    bench = BENCH_OF.get(name, name)
    options = _bench_options(bench)
    if options is None:
        return StepResult(name, "skipped", budget_s, note=f"recaccel-bench {bench} is not registered")
    argv = bench_argv(name, device, parts, options, plots)
    command = shlex.join(["recaccel-bench", *argv])
    allowed = clock.allowance(budget_s)
    if allowed < 5:
        return StepResult(name, "skipped", budget_s, command=command, note="no time left")
    log = parts / f"{name}.log"
    status, rc, seconds = run_step(
        [sys.executable, "-c", BENCH_ENTRY, *argv], log, allowed, _child_env(keep_triton_interpret=False)
    )
    note = {"timeout": f"killed at its budget ({allowed:.0f} s)", "failed": f"exit code {rc}"}.get(status, "")
    note = "; ".join(n for n in (note, _step_note(name, device, options)) if n)
    files = sorted(p.name for p in parts.glob(f"{name}.*"))
    tail = _tail(log) if status != "ok" else ""
    return StepResult(name, status, round(allowed), seconds, rc, command, note, tail, files)


def plan_text(only: Sequence[str], device: str, total_s: float) -> str:
    """The run's plan: each step to run, its budget and its command, and the overall limit."""
    col = 0 if device == "cuda" else 1
    lines = [f"gpu-check plan ({device}): ceilings, then"]
    for name in STEPS:
        if name in only:
            bench = BENCH_OF.get(name, name)
            what = (
                "pytest -m gpu"
                if name == "pytest"
                else f"recaccel-bench {bench} {shlex.join(BENCH_ARGS[device][name]) if name in BENCH_ARGS[device] else ''}"
            )
            lines.append(f"  {name:<12} {BUDGETS[name][col]:>4.0f} s  {what.strip()}")
    steps_s = sum(BUDGETS[n][col] for n in STEPS if n in only)
    lines.append(f"  steps {steps_s:.0f} s; the whole run is stopped at {total_s:.0f} s")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu-check", description="Verify and measure recaccel on a GPU (small mode on CPU)."
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="runs/gpu-check", help="output folder (default %(default)s)")
    parser.add_argument(
        "--only", help=f"comma-separated steps to run, of {','.join(STEPS)} (default: all; ceilings always)"
    )
    parser.add_argument("--budget-s", type=float, help="overall time limit (default 415 cuda, 300 cpu)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check; returns 0 when every step that ran ended well, 1 otherwise, 2 on bad usage."""
    args = parse_args(argv)
    only = STEPS if args.only is None else tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        print(f"gpu-check: error: unknown step(s) {unknown}; steps are {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: error: --device cuda, but torch sees no CUDA device (DEVICE=cpu runs the small mode)",
              file=sys.stderr)  # fmt: skip
        return 2
    clock = Clock(args.budget_s or TOTAL_BUDGET_S[args.device])
    out = Path(args.out).resolve()
    parts = out / "gpu_check_parts"
    parts.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    budget_col = 0 if args.device == "cuda" else 1
    plots = find_spec("matplotlib") is not None
    print(f"gpu-check: device {args.device}, out {out}", flush=True)
    print(plan_text(only, args.device, clock.total_s), flush=True)
    smi = nvidia_smi_line() if args.device == "cuda" else ""
    env = environment_info(device)
    ceilings = measure_ceilings(device)
    print(f"gpu-check: ceilings {ceilings}", flush=True)
    steps: list[StepResult] = []
    pytest_info: dict = {}
    for name in STEPS:
        budget = BUDGETS[name][budget_col]
        if name not in only:
            steps.append(StepResult(name, "skipped", budget, note="not in --only"))
            continue
        if name == "pytest":
            step, pytest_info = _run_pytest(args.device, out, clock, budget)
        else:
            step = _run_bench(name, args.device, parts, clock, budget, plots)
        steps.append(step)
        print(f"gpu-check: {name}: {step.status} in {step.seconds:.1f} s {step.note}".rstrip(), flush=True)
    report = {
        "device": args.device,
        "out": str(out),
        "env": env,
        "nvidia_smi": smi,
        "ceilings": ceilings,
        "plots": plots,
        "steps": [vars(s) for s in steps],
        "pytest": pytest_info,
        "targets": evaluate(parts, ceilings),
    }
    if not plots:
        report["steps"].append({"name": "plots", "status": "skipped", "note": "matplotlib is not installed"})
    report_files.finish(report, parts, out)
    print(report_files.summary_text(report), flush=True)
    return 0 if all(s.status in ("ok", "skipped") for s in steps) else 1
