"""The embedding caches' traffic (host-placed tables) for the run log and metrics.json."""

from __future__ import annotations

from torch import nn

from recaccel.ops.embedding import PackedEmbeddingBag
from recaccel.ops.embedding.cache.counters import SUMMED_KEYS
from recaccel.train.loop.observers import StepObserver


class CacheMeter(StepObserver):
    """Reads the device caches of a model's packed embeddings (a step observer: the
    traffic since the last ``train`` event in each, the totals in the final metrics).

    Counters are cumulative over the process's lookups (training and evaluation; a
    resumed run counts from its resume).

    Args:
        model: the module holding the embeddings (any depth).
    """

    def __init__(self, model: nn.Module) -> None:
        self._embeddings = [m for m in model.modules() if isinstance(m, PackedEmbeddingBag)]
        self._last: dict[str, float] | None = None
        self._last_step = 0

    name = "cache"

    def log_fields(self, step: int) -> dict[str, float]:
        return self.since_last(step)

    def final_metrics(self) -> dict[str, float]:
        return self.totals()

    def totals(self) -> dict[str, float]:
        """``cache_hit_rate`` and the summed counters and sizes; empty without host tables."""
        parts = [s for s in (e.cache_stats() for e in self._embeddings) if s]
        if not parts:
            return {}
        total = {key: sum(p.get(key, 0.0) for p in parts) for key in parts[0] if key != "cache_hit_rate"}
        total["cache_hit_rate"] = _hit_rate(total)
        return total

    def since_last(self, step: int) -> dict[str, float]:
        """For a log event at ``step``: the hit rate and the rows and bytes moved per step
        since the previous call, and the staging memory now; empty without host tables."""
        now = self.totals()
        if not now:
            return {}
        last = self._last or {key: 0.0 for key in SUMMED_KEYS}
        steps = max(step - self._last_step, 1)
        delta = {key: now[key] - last[key] for key in SUMMED_KEYS}
        self._last, self._last_step = now, step
        out = {"cache_hit_rate": _hit_rate(delta)}
        for key in SUMMED_KEYS[2:]:
            out[f"{key}_per_step"] = delta[key] / steps
        out["cache_staging_bytes"] = now.get("cache_staging_bytes", 0.0)
        return out


def _hit_rate(counters: dict[str, float]) -> float:
    """Hits over requests (0 before any request)."""
    return counters["cache_hits"] / counters["cache_requests"] if counters["cache_requests"] else 0.0
