"""Sorted occurrences cut into pieces for the piece-lane backward, on the device.

Each segment of equal keys (one packed row's occurrences, sorted) is cut into pieces of
at most ``piece_len`` occurrences counted from its start: a piece starts where an
occurrence's offset in its segment is a multiple of ``piece_len``.
:func:`reference_pieces` says it with whole-array torch ops (two binary searches over
all N keys, seven passes); :func:`build_pieces` runs two kernels over the keys:

- ``_piece_opens_kernel``: program ``i`` takes occurrences ``i*BLOCK ..``; the segment
  start of its first one comes from one scalar binary search (the first key equal to it),
  every later one's from a running maximum of segment starts within the block
  (``tl.associative_scan``). It marks the piece starts (int8) and counts them.
- ``_piece_starts_kernel``: after a cumulative sum of the blocks' counts (a tensor of
  ``cdiv(N, BLOCK)``), each program writes its piece starts at their ranks.

About 14 bytes an occurrence instead of the reference's ~100 and its searches; the
same integers (tested against it). No host synchronisation: every size is N, known on
the host.

Shapes: N sorted occurrences, P pieces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048  # occurrences a program


class Pieces(NamedTuple):
    """Sorted occurrences cut into pieces (:func:`build_pieces`).

    Attributes:
        start: int64 [N+1]: piece ``q`` is occurrences ``start[q] .. start[q+1]-1``;
            ``N`` from ``start[P]`` on.
        count: int64 [1] P, on the device.
    """

    start: Tensor
    count: Tensor


def reference_pieces(keys: Tensor, piece_len: int) -> Pieces:
    """:func:`build_pieces` in whole-array torch ops (the specification).

    Args:
        keys: int32 or int64 [N > 0] non-decreasing.
        piece_len: Most occurrences per piece.
    """
    n = keys.numel()
    index = torch.arange(n, device=keys.device)
    segment_start = torch.searchsorted(keys, keys)  # first occurrence of each key
    opens = torch.remainder(index - segment_start, piece_len) == 0
    count = torch.cumsum(opens, 0)
    # Piece q starts at the first occurrence whose running count of starts is q + 1.
    start = torch.searchsorted(count, torch.arange(1, n + 2, device=keys.device))
    return Pieces(start, count[-1:])


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _piece_opens_kernel(
    keys_ptr,  # int32/int64 [N] non-decreasing
    opens_ptr,  # out, int8 [N]: 1 where a piece starts
    counts_ptr,  # out, int64 [cdiv(N, BLOCK)] piece starts per program
    num_occ,
    PIECE_LEN: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCK
    idx = first + tl.arange(0, BLOCK)
    on = idx < num_occ
    key = tl.load(keys_ptr + idx, mask=on, other=0)
    prev = tl.load(keys_ptr + idx - 1, mask=on & (idx > 0), other=0)
    new_segment = (idx == 0) | (key != prev)
    # The segment start of the block's first occurrence: the first key equal to its key
    # (lower bound over 0 .. first; SEARCH_STEPS >= bit_length(N) halvings close it).
    first_key = tl.load(keys_ptr + first)
    lo = first * 0
    hi = first
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(keys_ptr + mid) < first_key
        next_lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & (below == 0), mid, hi)
        lo = next_lo
    segment_start = tl.associative_scan(tl.where(new_segment, idx, lo), 0, _max)
    opens = on & ((idx - segment_start) % PIECE_LEN == 0)
    tl.store(opens_ptr + idx, opens.to(tl.int8), mask=on)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(opens.to(tl.int64), axis=0))


@triton.jit
def _piece_starts_kernel(
    opens_ptr,  # int8 [N]
    ends_ptr,  # int64 [cdiv(N, BLOCK)] inclusive cumulative piece counts of the programs
    counts_ptr,  # int64 [cdiv(N, BLOCK)] piece starts per program
    start_ptr,  # out, int64 [N+1]: piece q's first occurrence at q
    num_occ,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    on = idx < num_occ
    opens = tl.load(opens_ptr + idx, mask=on, other=0).to(tl.int64)
    rank = tl.load(ends_ptr + pid) - tl.load(counts_ptr + pid) + tl.cumsum(opens, 0) - 1
    tl.store(start_ptr + rank, idx, mask=opens != 0)


def build_pieces(keys: Tensor, piece_len: int) -> Pieces:
    """Cuts the segments of sorted ``keys`` into pieces of at most ``piece_len`` occurrences
    (:func:`reference_pieces`' integers), with two kernel launches; no host synchronisation.

    Args:
        keys: int32 or int64 [N > 0] non-decreasing, contiguous.
        piece_len: Most occurrences per piece (>= 1).
    """
    n = keys.numel()
    programs = triton.cdiv(n, BLOCK)
    opens = torch.empty(n, dtype=torch.int8, device=keys.device)
    counts = torch.empty(programs, dtype=torch.int64, device=keys.device)
    _piece_opens_kernel[(programs,)](
        keys, opens, counts, n, PIECE_LEN=piece_len, SEARCH_STEPS=max(1, n.bit_length()), BLOCK=BLOCK
    )
    ends = torch.cumsum(counts, 0)
    start = torch.full((n + 1,), n, dtype=torch.int64, device=keys.device)
    _piece_starts_kernel[(programs,)](opens, ends, counts, start, n, BLOCK=BLOCK)
    return Pieces(start, ends[-1:])
