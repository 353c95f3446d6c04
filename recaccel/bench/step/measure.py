"""Timing the candidates of ``recaccel-bench train``: interleaved blocks of steps on
device data, each candidate alone through the reader, the instrumented phase pass and
the steps' peak memory."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from recaccel.bench.harness.timing import time_interleaved_samples
from recaccel.bench.step.candidates import PHASES, Candidate
from recaccel.bench.step.data import Preset, ReaderBatches, RotatingBatches
from recaccel.bench.step.phased import PhaseTimer

NO_DATA_WAIT = "none (batches already on the device)"


@dataclass(frozen=True)
class Timing:
    """How much each candidate runs.

    Attributes:
        steps: timed steps (at least; whole blocks).
        warmup: untimed steps first.
        phase_steps: instrumented steps of the phase breakdown.
        block: consecutive steps per timed sample.
        timeline_steps: profiled steps of the timeline (0: none).
    """

    steps: int
    warmup: int
    phase_steps: int
    block: int
    timeline_steps: int

    @property
    def samples(self) -> int:
        """Timed samples (blocks) per candidate."""
        return -(-self.steps // self.block)

    @property
    def warmup_blocks(self) -> int:
        return -(-self.warmup // self.block)

    @property
    def batches_per_run(self) -> int:
        """Batches one candidate takes through the reader (timed, warm-up, phases, and
        one more that a semi-sync pipeline takes ahead)."""
        return (self.samples + self.warmup_blocks) * self.block + self.phase_steps + 1


NOT_INSTRUMENTED = "not instrumented (a pipelined step's phases overlap: see the timeline)"


def phase_breakdown(
    candidate: Candidate, source, device: torch.device, phase_steps: int
) -> tuple[dict, float | None]:
    """The instrumented pass: each phase's median ms over ``phase_steps`` steps (merged
    phases say where they went; ``data_wait`` is left to the caller), and the median
    instrumented step (ms). A candidate without a phased step (a pipelined combination)
    says so instead, with no instrumented step."""
    if candidate.phased_step is None:
        return {phase: NOT_INSTRUMENTED for phase in PHASES if phase != "data_wait"}, None
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


def _summary(
    samples: list[float], waits: list[float] | None, phases: dict, instrumented: float | None
) -> dict:
    phases["data_wait"] = statistics.fmean(waits) if waits else NO_DATA_WAIT
    return {
        "step_ms": statistics.median(samples),
        "step_ms_mean": statistics.fmean(samples),
        "phases_ms": {phase: phases[phase] for phase in PHASES},
        "instrumented_step_ms": instrumented,
        # Per-step wait over per-step time: ``waits`` holds one entry per step, ``samples`` one per block.
        "data_wait_fraction": statistics.fmean(waits) / statistics.fmean(samples) if waits else None,
    }


def time_blocks(
    calls: dict[str, Callable[[], object]], timing: Timing, device: torch.device
) -> dict[str, list[float]]:
    """Per-step ms of each candidate: blocks of ``timing.block`` consecutive steps timed
    interleaved (one block of each per repeat, order rotating), each block's time over
    its steps."""
    blocks = {name: (lambda call=call: [call() for _ in range(timing.block)]) for name, call in calls.items()}
    samples = time_interleaved_samples(blocks, timing.samples, timing.warmup_blocks, device)
    return {name: [ms / timing.block for ms in values] for name, values in samples.items()}


def step_peak_mb(candidate: Candidate, batches: list, device: torch.device, steps: int = 3) -> float | None:
    """CUDA: the most memory a few consecutive steps of the candidate allocate beyond what
    was allocated before them (MB); None on other devices."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step = candidate.stepper(RotatingBatches(batches))
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del step
    return peak / 2**20


def measure_on_device(
    candidates: dict[str, Candidate], batches: list, device: torch.device, timing: Timing
) -> dict[str, dict]:
    """Device mode: the candidates' steps timed interleaved by blocks, then each one's
    instrumented pass and, on CUDA, its steps' peak memory."""
    sources = {key: RotatingBatches(batches) for key in candidates}
    calls = {key: c.stepper(sources[key]) for key, c in candidates.items()}
    samples = time_blocks(calls, timing, device)
    del calls  # ends the loops (a pipeline holds a batch ahead)
    out = {}
    for key, candidate in candidates.items():
        phases, instrumented = phase_breakdown(candidate, sources[key], device, timing.phase_steps)
        out[key] = _summary(samples[key], None, phases, instrumented)
        out[key]["step_peak_mb"] = step_peak_mb(candidate, batches, device)
    return out


def measure_through_reader(
    candidate: Candidate, data: Path, preset: Preset, device: torch.device, timing: Timing
) -> dict:
    """Reader mode: the candidate alone, each step's batch from a fresh BatchReader +
    DeviceLoader over ``data`` (one input pipeline with the trainer's reader processes,
    as in a real run; the trainer's loop takes the loader's (batch, position) pairs).
    The summary carries ``reader_workers``."""
    source = ReaderBatches(data, preset, device)
    try:
        call = candidate.stepper(source)
        samples = time_blocks({candidate.key: call}, timing, device)[candidate.key]
        del call
        waits = source.waits_ms[-timing.samples * timing.block :]
        phases, instrumented = phase_breakdown(candidate, source, device, timing.phase_steps)
    finally:
        source.close()
    return {**_summary(samples, waits, phases, instrumented), "reader_workers": source.workers}


NO_DATA_WAIT = "none (batches already on the device)"
