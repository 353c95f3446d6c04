"""Where a packed embedding lookup's time goes: per-kernel device time and host time of the
embedding benchmark's packed candidates (``recaccel-bench embedding --profile``; on CUDA
Triton's alone: :func:`~recaccel.bench.kernels.embedding_run.profile_skips`).

The benchmark times the module as a training step sees it (preparation, lookup, fused
backward update); the kernel sweep times the kernels alone. On the H200 (session 15) the
module took 8.2 ms where its two kernels took 2.6 ms (T=26 B=16384 D=128 L=20): this
profile says which kernels (the sort, the id gathers, the pieces' searches, copies) and
how much host time fill the difference. Each candidate is run a few times per mode under
``torch.profiler`` (:func:`~recaccel.bench.harness.profiling.profile_steps`, shapes
recorded, so each kernel is named with the op that launched it). Host ms per iteration is
timed apart, unprofiled: the host's time to issue an iteration, no synchronisation inside
(where it exceeds the device ms, the host is what limits the module); the host table adds
the Python functions that time goes to (:func:`~recaccel.bench.harness.python_profile.python_hotspots`).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from recaccel.bench.harness.profiling import profile_steps
from recaccel.bench.harness.python_profile import python_hotspots
from recaccel.bench.kernels.embedding_cases import MODES, BenchInputs, Candidate, EmbeddingCase, mode_calls
from recaccel.bench.kernels.kernel_breakdown import breakdown_rows, write_breakdown

log = logging.getLogger(__name__)

PROFILE_ITERATIONS = 3  # profiled calls per candidate and mode (after one unprofiled call)
HOST_ROWS = 15  # host ops kept per candidate and mode in the host table


class CaseProfiles:
    """The kernel tables, host ms and host-op tables of the profiled cases so far, written
    to disk after every case (a run killed at its budget keeps the cases done)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tables: dict[str, list[dict]] = {}
        self.host_ms: dict[str, float] = {}
        self.host_text: list[str] = []
        self.error: str | None = None  # why profiling stopped (the timed rows stand without it)

    @property
    def host_path(self) -> Path:
        """Where the host-op tables go: beside the kernel tables, ``<stem>_host.txt``."""
        return self.path.with_name(f"{self.path.stem.removesuffix('_kernels')}_host.txt")

    def add_case(
        self,
        case: EmbeddingCase,
        cands: Mapping[str, Candidate],
        inputs: BenchInputs,
        device: torch.device,
        skip: Sequence[str] = (),
        iterations: int = PROFILE_ITERATIONS,
    ) -> None:
        """Profiles every candidate but ``skip`` in both modes on ``case``, then rewrites the
        files; after a profiler failure (CUPTI, the trace), records why and profiles no more."""
        if self.error is not None:
            return
        try:
            self._add_case(case, cands, inputs, device, skip, iterations)
        except Exception as e:  # the profiler can fail where timing did not
            first = (str(e).strip().splitlines() or [""])[0]
            self.error = f"{type(e).__name__}: {first}"
            log.warning("embedding bench: profiling stopped: %s", self.error)
            if self.tables:  # what was profiled before the failure, so the note names real files
                self.write(iterations)

    def _add_case(self, case, cands, inputs, device, skip, iterations) -> None:
        shape = f"T={case.tables} B={case.batch} D={case.dim} L={case.bag_len}"
        for name, cand in cands.items():
            if name in skip:
                continue
            for mode, call in mode_calls(cand, inputs).items():
                self._profile(f"{name} {MODES[mode]} {shape}", call, device, iterations)
        self.write(iterations)

    def _profile(self, key: str, step: Callable[[], object], device: torch.device, iterations: int) -> None:
        step()  # compiled and warm before the profiler starts
        self.host_ms[key] = _issue_ms(step, device, iterations)
        with tempfile.TemporaryDirectory(prefix="recaccel-embedding-profile-") as tmp:
            host_file = Path(tmp) / "host.txt"
            timeline = profile_steps(step, iterations, device, host_file)
            host = host_file.read_text().splitlines()
        self.tables[key] = breakdown_rows(timeline)
        python = python_hotspots(step, iterations, rows=HOST_ROWS)
        self.host_text += [f"## {key}", "", *host[: HOST_ROWS + 4], "", *python, ""]

    def write(self, iterations: int) -> Path:
        """Writes the kernel tables (markdown) and the host-op tables (text); returns the first."""
        title = "packed embedding bag, module as a training step calls it"
        write_breakdown(self.tables, self.path, title, iterations, host_ms=self.host_ms)
        self.host_path.write_text("\n".join(self.host_text) + "\n")
        return self.path


def _issue_ms(step: Callable[[], object], device: torch.device, iterations: int) -> float:
    """Host ms to issue one iteration, unprofiled (the profiler's own per-op cost, shapes
    recorded, about doubles a host-bound step): ``iterations`` calls after a synchronisation,
    none inside, timed before the closing one. A few iterations of a few hundred launches
    stay under CUDA's launch queue, so a busy device does not block the host into its time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    issued = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * issued / iterations


def profile_note(profiles: CaseProfiles) -> str:
    """The benchmark markdown's note naming the profile's files, or saying why there are none."""
    if not profiles.tables:
        return f"Per-kernel device time: none ({profiles.error or 'no packed candidate ran'})"[:300]
    return (
        f"Per-kernel device time and host ms per iteration of each profiled candidate and mode: "
        f"{profiles.path.name} (each kernel with the op that launched it); host ops by self CPU time "
        f"and Python functions by own time: {profiles.host_path.name}"
        + (f"; profiling stopped: {profiles.error}" if profiles.error else "")
    )
