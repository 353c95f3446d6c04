"""``make gpu-check``: verify and measure everything on a lent GPU, in two commands.

``python -m recaccel.bench.gpu_check --device cuda --part checks|steps --out DIR`` (the
tree run as ``PYTHONPATH=.``), each part within 7 minutes on one H100 / H200
(:mod:`recaccel.bench.gpu_check.plan`: the parts, budgets and sizes; the plan, each step
with its budget, is printed first; the kernel tuning run fits beside part ``steps`` in
one 10-minute command):

1. environment (``nvidia-smi``, torch, Triton, device) and the two ceilings of this run:
   device-to-device copy bandwidth (bytes read + written, median) and the bf16 matmul
   rate (8192^3, random data);
2. (part checks) ``pytest -m gpu``: the files marking GPU tests in up to four groups,
   balanced by their seconds (:mod:`~recaccel.bench.gpu_check.timings`), run as pytest
   processes at once (:mod:`~recaccel.bench.gpu_check.pytest_groups`; the lent machines
   have no pytest-xdist), their logs joined in ``DIR/pytest.txt``, their per-test times
   summed per file into the tarball's ``test_seconds.json``;
3. the ``recaccel-bench`` benchmarks of the part at GPU sizes, each a subprocess writing
   markdown, JSON and plots (a benchmark not registered yet is skipped with a line):
   checks: embedding, dot interaction, DCN-v2 cross network (bf16), host tables behind
   the cache (``cache_train``), meta; steps: training under tf32 and bf16 on
   ``bench_criteo_1hot`` and ``bench_wide``, the DCN-v2 preset, io (rows/s per reader
   worker count on the criteo_1hot and wide schemas);
4. a closing summary printed last: steps, pytest's line, each GPU target with its
   figure and met / not met / not measured (:mod:`recaccel.bench.gpu_check.targets`);
   a target of the other part reads "not measured (part ...)".

Every subprocess step has a time budget; one that overruns is killed (its whole
process group) and reported, and the rest still run. ``--device cpu`` is the small
mode: the same steps at tiny sizes in well under a minute per part, with a fast pytest
selection instead of the GPU suite (which skips without CUDA), CPU copies and an fp32
matmul for the ceilings. Files left in ``DIR``: :mod:`recaccel.bench.gpu_check.report`.
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
from recaccel.bench.gpu_check import timings
from recaccel.bench.gpu_check.gpu_tests import gpu_test_files
from recaccel.bench.gpu_check.plan import (
    BENCH_ARGS,
    BENCH_OF,
    BUDGETS,
    CPU_PYTEST,
    DEFAULT_PART,
    PARTS,
    STEPS,
    TINY_TRAIN_CONFIG,
    TOTAL_BUDGET_S,
    TRAIN_PRECISIONS,
    plan_text,
    run_limit,
    select_steps,
    skip_reason,
    unknown_steps,
)
from recaccel.bench.gpu_check.pytest_groups import balance, join_logs, run_groups, sum_summaries
from recaccel.bench.gpu_check.targets import evaluate, mark_not_run
from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.timing import measure_copy_bandwidth, time_interleaved

REPO = Path(__file__).resolve().parents[3]
BENCH_ENTRY = "import sys; from recaccel.cli import bench_main; sys.exit(bench_main())"
# Seconds a pytest group has, after its SIGINT at the budget, to write its junit XML and summary.
PYTEST_GRACE_S = 5.0
# Seconds one GPU test may take (pytest-timeout, where installed: the lent machines have it).
# A test past it fails with its stack instead of holding its group until the budget kills
# the group's later files unrun (the H200 run of session 15 lost two files so). A test
# blocked inside a CUDA call is not interrupted until it returns, so every thread's stack is
# also dumped (pytest's own faulthandler, no plugin) once a test passes STACK_DUMP_S.
PER_TEST_TIMEOUT_S = 60
STACK_DUMP_S = 40
__all__ = ["BENCH_ARGS", "BUDGETS", "PARTS", "STEPS", "TOTAL_BUDGET_S", "main", "plan_text", "run_step"]


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


def junit_path(parts: Path, group: int) -> Path:
    """Where pytest group ``group`` writes its per-test times (junit XML)."""
    return parts / f"pytest_group{group}.xml"


def junit_options(parts: Path, group: int) -> list[str]:
    """pytest options writing group ``group``'s per-test times as junit XML into ``parts``;
    xunit1 names each test case's file (xunit2, the default, only its class path)."""
    return [f"--junit-xml={junit_path(parts, group)}", "-o", "junit_family=xunit1"]


def pytest_groups(device: str, parts: Path) -> list[list[str]]:
    """The pytest processes of the step, run at once (:mod:`~recaccel.bench.gpu_check.pytest_groups`):
    the GPU suite's files in up to four groups balanced by their seconds
    (:mod:`~recaccel.bench.gpu_check.timings`) on CUDA; a fast selection in the small mode.
    Each group writes its per-test times as junit XML into ``parts``."""
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    if device != "cuda":
        return [[*base, "-q", *junit_options(parts, 0), *CPU_PYTEST]]
    # The GPU tests are independent: four processes share the GPU (Triton's compiles, the
    # larger part of the serial suite's time, run on four cores). -v names each test as it
    # ends: a group killed at the budget shows where it was.
    groups = max(1, min(4, (os.cpu_count() or 1) // 4))
    known = timings.file_seconds(timings.load_seconds())
    files = balance(timings.weights(gpu_test_files(REPO / "tests", REPO), known), groups)
    options = ["-v", "-m", "gpu", "--continue-on-collection-errors", "--durations=5", *per_test_timeout()]
    options += ["-o", f"faulthandler_timeout={STACK_DUMP_S}"]
    return [[*base, *options, *junit_options(parts, i), *group] for i, group in enumerate(files)]


def per_test_timeout() -> list[str]:
    """pytest options failing any one test after :data:`PER_TEST_TIMEOUT_S` (its stack
    printed, the group going on), where the pytest-timeout plugin is installed; none otherwise."""
    if find_spec("pytest_timeout") is None:
        return []
    return [f"--timeout={PER_TEST_TIMEOUT_S}", "--timeout-method=signal"]


def _record_seconds(
    argvs: Sequence[Sequence[str]], ended: Sequence, parts: Path, device_name: str
) -> dict[str, float]:
    """Sums the groups' junit XML per file into ``parts/test_seconds.json`` (the committed
    figures, those measured now replaced); returns the measured ones."""
    xml = [junit_path(parts, i) for i in range(len(argvs))]
    cut = [path for path, e in zip(xml, ended) if e.status == "timeout"]
    files = [a for argv in argvs for a in argv if a.endswith(".py")]
    run = f"gpu-check {time.strftime('%Y-%m-%d')}"
    measured = timings.write_measured(parts / timings.COMMITTED.name, xml, files, device_name, run, cut)
    for path in xml:
        path.unlink(missing_ok=True)  # summed into test_seconds.json
    return measured


class Clock:
    """The run's overall deadline; each step gets its budget or what is left, whichever is less."""

    def __init__(self, total_s: float, reserve_s: float = 10.0) -> None:
        self.total_s = total_s
        self.deadline = time.monotonic() + total_s
        self.reserve_s = reserve_s

    def allowance(self, budget_s: float) -> float:
        return min(budget_s, self.deadline - time.monotonic() - self.reserve_s)


def _run_pytest(
    device: str, out: Path, parts: Path, clock: Clock, budget_s: float, device_name: str
) -> tuple[StepResult, dict]:
    if not (REPO / "tests").is_dir():
        return StepResult("pytest", "skipped", budget_s, note=f"no tests/ in {REPO}"), {"command": ""}
    argvs = pytest_groups(device, parts)
    command = " & ".join(shlex.join(["python", *argv[1:]]) for argv in argvs)
    allowed = clock.allowance(budget_s)
    if allowed < 5:
        return StepResult("pytest", "skipped", budget_s, note="no time left"), {"command": command}
    logs = [out / f"pytest_group{i}.txt" for i in range(len(argvs))]
    t0 = time.monotonic()
    grace = min(PYTEST_GRACE_S, allowed / 4)  # within the budget: interrupted, then killed
    ended = run_groups(argvs, logs, allowed - grace, _child_env(keep_triton_interpret=True), REPO, grace)
    seconds = time.monotonic() - t0
    text = join_logs(argvs, logs, ended, out / report_files.PYTEST_LOG)
    summary = sum_summaries(
        [report_files.pytest_summary(log.read_text(errors="replace")) for log in logs], seconds
    )
    for log in logs:
        log.unlink(missing_ok=True)  # joined into pytest.txt
    measured = _record_seconds(argvs, ended, parts, device_name)
    killed = [argv for argv, e in zip(argvs, ended) if e.status == "timeout"]
    status = "timeout" if killed else "failed" if any(e.status == "failed" for e in ended) else "ok"
    if killed:
        # The files a stopped group did not finish (its junit XML names those it did).
        files = [a for argv in killed for a in argv if a.endswith(".py") and a not in measured]
        rest = shlex.join(["python", "-m", "pytest", "-m", "gpu", *files])
        summary = f"killed after {seconds:.0f} s (budget {allowed:.0f} s); so far: {summary or '-'}; the rest: {rest}"
    rc = max((e.rc for e in ended if e.rc not in (None, 0, 5)), default=None if killed else 0)
    info = {"command": command, "summary": summary, "failures": report_files.pytest_failures(text), "rc": rc,
            "file_seconds": measured}  # fmt: skip
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu-check", description="Verify and measure recaccel on a GPU (small mode on CPU)."
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="runs/gpu-check", help="output folder (default %(default)s)")
    parser.add_argument(
        "--part",
        choices=(*PARTS, "all"),
        default=DEFAULT_PART,
        help="which part to run: "
        + "; ".join(f"{k}: {','.join(v)}" for k, v in PARTS.items())
        + "; all: both (over 7 minutes on CUDA) (default %(default)s)",
    )
    parser.add_argument(
        "--only",
        help=f"comma-separated steps to run, of any part (overrides --part), of {','.join(STEPS)}"
        " (ceilings always)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="overall time limit (default on cuda: the steps' budgets plus 25 s; 300 on cpu)",
    )
    return parser.parse_args(argv)


def _usage_error(args: argparse.Namespace) -> str:
    """Why the command line cannot run here (one line), or ``""``."""
    unknown = unknown_steps(args.only)
    if unknown:
        return f"unknown step(s) {unknown}; steps are {', '.join(STEPS)}"
    if args.only is not None and not select_steps(args.part, args.only):
        return "--only names no step"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda, but torch sees no CUDA device (DEVICE=cpu runs the small mode)"
    return ""


def _run_steps(
    args: argparse.Namespace, selected: Sequence[str], out: Path, clock: Clock, env: dict
) -> tuple[list[StepResult], dict]:
    """Every step in order: those selected under their budgets, the others reported skipped with why."""
    parts = out / "gpu_check_parts"
    col = 0 if args.device == "cuda" else 1
    plots = find_spec("matplotlib") is not None
    steps: list[StepResult] = []
    pytest_info: dict = {}
    for name in STEPS:
        budget = BUDGETS[name][col]
        if name not in selected:
            steps.append(StepResult(name, "skipped", budget, note=skip_reason(name, args.only)))
            continue
        if name == "pytest":
            step, pytest_info = _run_pytest(
                args.device, out, parts, clock, budget, str(env.get("device", ""))
            )
        else:
            step = _run_bench(name, args.device, parts, clock, budget, plots)
        steps.append(step)
        print(f"gpu-check: {name}: {step.status} in {step.seconds:.1f} s {step.note}".rstrip(), flush=True)
    if not plots:
        steps.append(StepResult("plots", "skipped", note="matplotlib is not installed"))
    return steps, pytest_info


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check; returns 0 when every step that ran ended well, 1 otherwise, 2 on bad usage."""
    args = parse_args(argv)
    error = _usage_error(args)
    if error:
        print(f"gpu-check: error: {error}", file=sys.stderr)
        return 2
    selected = select_steps(args.part, args.only)
    clock = Clock(args.budget_s or run_limit(selected, args.device))
    out = Path(args.out).resolve()
    parts = out / "gpu_check_parts"
    parts.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    part = "only" if args.only is not None else args.part
    print(f"gpu-check: device {args.device}, out {out}", flush=True)
    print(plan_text(selected, args.device, clock.total_s, part), flush=True)
    smi = nvidia_smi_line() if args.device == "cuda" else ""
    env = environment_info(device)
    ceilings = measure_ceilings(device)
    print(f"gpu-check: ceilings {ceilings}", flush=True)
    steps, pytest_info = _run_steps(args, selected, out, clock, env)
    not_run = {s.name: s.note for s in steps if s.name in STEPS and s.name not in selected}
    report = {
        "device": args.device,
        "part": part,
        "out": str(out),
        "env": env,
        "nvidia_smi": smi,
        "ceilings": ceilings,
        "plots": find_spec("matplotlib") is not None,
        "steps": [vars(s) for s in steps],
        "pytest": pytest_info,
        "targets": mark_not_run(evaluate(parts, ceilings), not_run),
    }
    report_files.finish(report, parts, out, report_files.stem_of(args.part if args.only is None else None))
    print(report_files.summary_text(report), flush=True)
    return 0 if all(s.status in ("ok", "skipped") for s in steps) else 1
