"""Interleaved timing: candidates timed in the same process and run, interleaved within
every repeat (their order rotating from repeat to repeat, so drift and warm-cache position
effects hit all alike), summarised by the median. On CUDA each call is bracketed by CUDA
events and the device synchronised before reading them; on CPU ``time.perf_counter``
brackets each call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved_samples(
    candidates: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device | str,
) -> dict[str, list[float]]:
    """Times each candidate ``repeats`` times, interleaved; returns every sample in ms.

    Args:
        candidates: name -> zero-argument callable doing one unit of work.
        repeats: Timed calls per candidate (>= 1).
        warmup: Untimed calls per candidate first (compilation, caches, allocator).
        device: Where the work runs; CUDA is timed with events.

    Returns:
        name -> ``repeats`` durations in milliseconds, in call order.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    if device.type == "cuda":
        events = {name: [] for name in names}
        for r in range(repeats):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                candidates[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize(device)
        for name in names:
            samples[name] = [s.elapsed_time(e) for s, e in events[name]]
        return samples
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            t0 = time.perf_counter()
            candidates[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return samples


def time_interleaved(
    candidates: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device | str,
) -> dict[str, float]:
    """Median milliseconds per candidate, timed interleaved (see :func:`time_interleaved_samples`)."""
    samples = time_interleaved_samples(candidates, repeats, warmup, device)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure_copy_bandwidth(
    device: torch.device | str, nbytes: int | None = None, repeats: int = 20, warmup: int = 3
) -> float:
    """Achievable memory bandwidth in GB/s, counting bytes read plus bytes written.

    A device-to-device copy of a large buffer on CUDA (default 1 GiB), a memcpy of a
    large tensor on CPU (default 128 MiB); random contents, median of ``repeats``.

    Args:
        device: Where to measure.
        nbytes: Buffer size in bytes.
        repeats: Timed copies.
        warmup: Untimed copies first.

    Returns:
        GB/s (1e9 bytes per second).
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 2**27
    n = nbytes // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    ms = time_interleaved({"copy": lambda: dst.copy_(src)}, repeats, warmup, device)["copy"]
    return 2 * n * 4 / (ms * 1e-3) / 1e9
