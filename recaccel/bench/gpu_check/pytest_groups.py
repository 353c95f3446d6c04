"""The GPU test suite as several pytest processes at once: gpu-check's pytest step.

The lent GPU machines have pytest but not pytest-xdist, and run serially the GPU suite
took longer than its budget (155 s of 160 on the first H200, most of it Triton compiling
kernels on one core). So the files holding GPU tests are found by reading them
(:mod:`~recaccel.bench.gpu_check.gpu_tests`), balanced over a few groups by their seconds
(:mod:`~recaccel.bench.gpu_check.timings`; by test count, the H200 put the slow files
together), and each group runs as its own ``pytest -m gpu FILES`` process, all at once, under one
deadline: the compiles spread over the cores, the tests share the GPU. A group still
running at the deadline is killed with whatever it started, and its files are named as
the command to run the rest. The groups' logs are joined into one, and their closing
lines summed into one pytest line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b")
_ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "error", "warning")


def balance(files: Sequence[tuple[str, float]], groups: int) -> list[list[str]]:
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


def _interrupt(procs: Sequence[subprocess.Popen], pending: Sequence[int], grace_s: float) -> set[int]:
    """Sends SIGINT to each pending process (pytest then ends its session: it writes its junit
    XML and closing line) and waits up to ``grace_s`` for them; returns the ones interrupted."""
    for i in pending:
        if procs[i].poll() is None:
            procs[i].send_signal(signal.SIGINT)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(procs[i].poll() is None for i in pending):
        time.sleep(0.05)
    return set(pending)


def run_groups(
    argvs: Sequence[Sequence[str]],
    logs: Sequence[Path],
    timeout_s: float,
    env: dict[str, str],
    cwd: Path,
    grace_s: float = 0.0,
) -> list[GroupResult]:
    """Runs every ``argvs[i]`` at once, its output into ``logs[i]``, until each has ended or
    ``timeout_s`` has passed; then interrupts each one still running (SIGINT, up to
    ``grace_s`` to end; none when 0) and kills what is left of its process group.

    pytest's exit status 5 (no test collected: every GPU test skipped) counts as ok.
    """
    t0 = time.monotonic()
    deadline = t0 + max(timeout_s, 0.1)
    sinks = [open(log, "wb") for log in logs]  # noqa: SIM115 (closed below, after the children)
    procs = []
    interrupted: set[int] = set()
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
        pending = [i for i, r in enumerate(results) if r is None and procs[i].poll() is None]
        interrupted = _interrupt(procs, pending, grace_s) if grace_s > 0 else set()
    finally:
        killed = set()
        for i, proc in enumerate(procs):
            if proc.poll() is None or i in interrupted:
                with contextlib.suppress(ProcessLookupError):  # an interrupted group may be gone
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
