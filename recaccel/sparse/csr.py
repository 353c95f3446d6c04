"""Index helpers of the batch types' CSR operations."""

from __future__ import annotations

import torch
from torch import Tensor


def runs_index(starts: Tensor, counts: Tensor, n: int, run_start: Tensor | None = None) -> Tensor:
    """Positions of K contiguous runs laid end to end: run k is ``starts[k] .. starts[k] + counts[k] - 1``.

    Args:
        starts: int64 [K] where each run begins.
        counts: int64 [K] run lengths.
        n: ``counts.sum()`` (given, so the caller decides whether it costs a host sync).
        run_start: int64 [K] where each run begins in the packed order; default the
            exclusive cumulative sum of ``counts`` (the runs packed back to back).

    Returns:
        int64 [n]: for the i-th element of run k, ``starts[k] + i``.
    """
    device = counts.device
    run_of = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=n)
    if run_start is None:
        run_start = torch.cumsum(counts, 0) - counts
    return torch.arange(n, device=device) + (starts - run_start)[run_of]


def check_rows(lo: int, hi: int, n: int, unit: str) -> None:
    """Refuses a range ``[lo, hi)`` outside ``[0, n]`` (slicing would clip it silently)."""
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"{unit} [{lo}, {hi}) are not within the batch's {n} {unit}")
