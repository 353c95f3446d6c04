"""How a batch's rows split into micro-batches (``train.micro_batches``)."""

from __future__ import annotations


def part_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive row ranges of near-equal size covering ``rows`` (fewer when
    rows < parts; none for an empty batch).

    >>> part_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    parts = max(1, min(parts, rows))
    base, extra = divmod(rows, parts)
    bounds, lo = [], 0
    for j in range(parts if rows else 0):
        hi = lo + base + (1 if j < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds
