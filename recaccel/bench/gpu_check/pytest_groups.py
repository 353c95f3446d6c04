"""The GPU test suite as several pytest processes at once: gpu-check's pytest step.

The lent GPU machines have pytest but not pytest-xdist, and run serially the GPU suite
took longer than its budget (155 s of 160 on the first H200, most of it Triton compiling
kernels on one core). So the files that mark tests ``gpu`` are found by reading them (no
collection of the whole suite), balanced over a few groups by their number of tests,
and each group runs as its own ``pytest -m gpu FILES`` process, all at once, under one
deadline: the compiles spread over the cores, the tests share the GPU. A group still
running at the deadline is killed with whatever it started, and its files are named as
the command to run the rest. The groups' logs are joined into one, and their closing
lines summed into one pytest line.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

GPU_MARK = re.compile(r"mark\.gpu\b")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b")
_ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "error", "warning")


def gpu_test_files(tests: Path, root: Path) -> list[tuple[str, int]]:
    """Every test file under ``tests`` that marks a test ``gpu`` (``pytest.mark.gpu`` in its
    code, not in a string), with its number of GPU test functions (its weight), as paths
    relative to ``root``, sorted. A file that does not parse weighs 1 (pytest reports it)."""
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if not GPU_MARK.search(text):
            continue
        weight = gpu_tests_in(text)
        if weight:
            found.append((path.relative_to(root).as_posix(), weight))
    return found


def gpu_tests_in(source: str) -> int:
    """The test functions of a module that run under ``-m gpu``: all of them when the module
    sets ``pytestmark`` to (a list holding) the mark, else those whose decorators hold it
    (``@pytest.mark.gpu``, a module-level alias such as ``gpu = pytest.mark.gpu`` then
    ``@gpu``, or ``pytest.param(..., marks=pytest.mark.gpu)`` in a parametrization), and those
    taking a fixture of the module with a parameter so marked. Conftest fixtures are not
    read (none marks a parameter ``gpu``; a test compares this with pytest's collection)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return 1
    aliases: set[str] = set()
    module_marked = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and _has_gpu_mark(node.value, aliases):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            module_marked |= "pytestmark" in names
            aliases |= names - {"pytestmark"}
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    tests = [f for f in functions if f.name.startswith("test_")]
    if module_marked:
        return len(tests)
    marked = _gpu_fixtures([f for f in functions if f not in tests], aliases)
    return sum(
        any(_has_gpu_mark(d, aliases) for d in t.decorator_list) or any(a.arg in marked for a in t.args.args)
        for t in tests
    )


def _gpu_fixtures(functions: list[ast.FunctionDef | ast.AsyncFunctionDef], aliases: set[str]) -> set[str]:
    """Names of the module's fixtures that give their tests the mark: a parameter marked
    ``gpu`` (``pytest.param("cuda", marks=pytest.mark.gpu)``), or a fixture taking one."""
    marked = {f.name for f in functions if any(_has_gpu_mark(d, aliases) for d in f.decorator_list)}
    grew = True
    while grew:
        before = len(marked)
        marked |= {f.name for f in functions if any(a.arg in marked for a in f.args.args)}
        grew = len(marked) > before
    return marked


def _has_gpu_mark(node: ast.AST, aliases: set[str]) -> bool:
    """Whether ``node`` holds a ``<...>.mark.gpu`` attribute or a name in ``aliases``."""
    return any(
        (
            isinstance(n, ast.Attribute)
            and n.attr == "gpu"
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "mark"
        )
        or (isinstance(n, ast.Name) and n.id in aliases)
        for n in ast.walk(node)
    )


def balance(files: Sequence[tuple[str, int]], groups: int) -> list[list[str]]:
    """Files dealt into at most ``groups`` groups of about equal weight: heaviest first,
    each to the lightest group so far (ties by name, so the split is the same every run).
    Empty groups are dropped; each group's files keep their sorted order."""
    loads = [[0, i, []] for i in range(max(1, groups))]
    for name, weight in sorted(files, key=lambda f: (-f[1], f[0])):
        lightest = min(loads, key=lambda g: (g[0], g[1]))
        lightest[0] += weight
        lightest[2].append(name)
    return [sorted(g[2]) for g in loads if g[2]]


@dataclass
class GroupResult:
    """How one pytest process ended."""

    status: str  # ok | failed | timeout
    rc: int | None
    seconds: float


def run_groups(
    argvs: Sequence[Sequence[str]], logs: Sequence[Path], timeout_s: float, env: dict[str, str], cwd: Path
) -> list[GroupResult]:
    """Runs every ``argvs[i]`` at once, its output into ``logs[i]``, until each has ended or
    ``timeout_s`` has passed; then kills each one still running with its process group.

    pytest's exit status 5 (no test collected: every GPU test skipped) counts as ok.
    """
    t0 = time.monotonic()
    deadline = t0 + max(timeout_s, 0.1)
    sinks = [open(log, "wb") for log in logs]  # noqa: SIM115 (closed below, after the children)
    procs = []
    try:
        for argv, sink in zip(argvs, sinks):
            procs.append(
                subprocess.Popen(
                    list(argv),
                    cwd=cwd,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        results: list[GroupResult | None] = [None] * len(procs)
        while any(r is None for r in results):
            for i, proc in enumerate(procs):
                if results[i] is None and proc.poll() is not None:
                    rc = proc.returncode
                    results[i] = GroupResult("ok" if rc in (0, 5) else "failed", rc, time.monotonic() - t0)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    finally:
        killed = set()
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed.add(i)
        for sink in sinks:
            sink.close()
    spent = time.monotonic() - t0
    for i, proc in enumerate(procs):  # one that ended between the last look and the deadline
        if results[i] is None and i not in killed:
            results[i] = GroupResult("ok" if proc.returncode in (0, 5) else "failed", proc.returncode, spent)
    return [r if r is not None else GroupResult("timeout", None, spent) for r in results]


def join_logs(
    argvs: Sequence[Sequence[str]], logs: Sequence[Path], ended: Sequence[GroupResult], joined: Path
) -> str:
    """The groups' logs in one file, each under a line naming its command and how it ended."""
    parts = []
    for i, (argv, log, e) in enumerate(zip(argvs, logs, ended)):
        head = f"=== gpu-check pytest group {i + 1}/{len(argvs)}: {e.status}, {e.seconds:.0f} s: {shlex.join(['python', *argv[1:]])}"
        body = log.read_text(errors="replace") if log.exists() else ""
        tail = f"\ngpu-check: group {i + 1} killed at the budget\n" if e.status == "timeout" else ""
        parts.append(f"{head}\n{body}{tail}")
    text = "\n".join(parts)
    joined.write_text(text)
    return text


def sum_summaries(lines: Sequence[str], seconds: float) -> str:
    """pytest closing lines (``"3 failed, 40 passed, 2 skipped in 50.1s"``) summed into one
    for a run of ``seconds``; ``""`` when none has a count."""
    totals: dict[str, int] = {}
    for line in lines:
        for count, kind in _COUNT.findall(line):
            kind = kind.rstrip("s") if kind in ("errors", "warnings") else kind
            totals[kind] = totals.get(kind, 0) + int(count)
    if not totals:
        return ""
    # pytest's nouns: "1 error", "2 errors"; "passed", "failed"... never change.
    noun = lambda k: k + ("s" if k in ("error", "warning") and totals[k] != 1 else "")  # noqa: E731
    parts = [f"{totals[k]} {noun(k)}" for k in _ORDER if totals.get(k)]
    return f"{', '.join(parts)} in {seconds:.2f}s"
