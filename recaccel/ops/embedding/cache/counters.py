"""A host pack's cache counters and the statistics the module reports from them."""

from __future__ import annotations

import dataclasses

# Statistics that add up over packs and steps (a hit rate is recomputed from two of them).
SUMMED_KEYS = (
    "cache_requests",
    "cache_hits",
    "cache_rows_fetched",
    "cache_rows_evicted",
    "cache_bytes_h2d",
    "cache_bytes_d2h",
)
STAT_KEYS = ("cache_hit_rate", *SUMMED_KEYS, "cache_staging_bytes", "cache_rows")


@dataclasses.dataclass
class CacheCounters:
    """Cumulative counters of one pack's cache.

    Attributes:
        requests: Unique rows requested by preparations (a row counts once per batch).
        hits: Those already resident when requested.
        fetched: Rows copied host to device (fetches and refreshes).
        evicted: Occupied slots reused for another row.
        bytes_h2d: Bytes copied host to device (rows and optimizer state).
        bytes_d2h: Bytes copied device to host (dirty rows written back).
    """

    requests: int = 0
    hits: int = 0
    fetched: int = 0
    evicted: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0


def merge_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """The cache statistics of some host packs (each :meth:`CachedPack.stats`), summed."""
    total = {key: 0.0 for key in STAT_KEYS}
    for one in stats:
        for key, value in one.items():
            total[key] += value
    total["cache_hit_rate"] = (
        total["cache_hits"] / total["cache_requests"] if total["cache_requests"] else 0.0
    )
    return total
