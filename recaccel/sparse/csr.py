"""Index helpers of the batch types' CSR operations."""

from __future__ import annotations

import torch
from torch import Tensor


def run_of(counts: Tensor, n: int, *, search: bool | None = None) -> Tensor:
    """int64 [n]: the run of each element of K runs of ``counts`` laid end to end.

    From ``repeat_interleave`` on the CPU (a linear pass) and from a search among the runs'
    ends on CUDA, where ``repeat_interleave`` writes each run with one warp: a batch's fields
    (K = F = 26 runs of up to 1.7 M ids) would be written by 26 warps (~0.09 ms on the H200,
    session 15) where the search is one parallel pass.

    Args:
        counts: int32 or int64 [K] run lengths (``n`` in all).
        n: ``counts.sum()``.
        search: search the runs' ends (None: on CUDA).
    """
    device = counts.device
    if counts.is_cuda if search is None else search:
        return torch.searchsorted(torch.cumsum(counts, 0), torch.arange(n, device=device), right=True)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=n)


def runs_index(
    starts: Tensor, counts: Tensor, n: int, run_start: Tensor | None = None, *, search: bool | None = None
) -> Tensor:
    """Positions of K contiguous runs laid end to end: run k is ``starts[k] .. starts[k] + counts[k] - 1``.

    Args:
        starts: int64 [K] where each run begins.
        counts: int64 [K] run lengths.
        n: ``counts.sum()`` (given, so the caller decides whether it costs a host sync).
        run_start: int64 [K] where each run begins in the packed order; default the
            exclusive cumulative sum of ``counts`` (the runs packed back to back).
        search: find each element's run by searching the runs' ends (:func:`run_of`).

    Returns:
        int64 [n]: for the i-th element of run k, ``starts[k] + i``.
    """
    if run_start is None:
        run_start = torch.cumsum(counts, 0) - counts
    return torch.arange(n, device=counts.device) + (starts - run_start)[run_of(counts, n, search=search)]


def check_rows(lo: int, hi: int, n: int, unit: str) -> None:
    """Refuses a range ``[lo, hi)`` outside ``[0, n]`` (slicing would clip it silently)."""
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"{unit} [{lo}, {hi}) are not within the batch's {n} {unit}")
