"""How a host-placed pack's device cache is sized and run: :class:`CacheOptions`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from recaccel.config import CachePolicy, choices
from recaccel.errors import ConfigError

POLICIES = choices(CachePolicy)  # lru, lfu


@dataclass(frozen=True)
class CacheOptions:
    """The device cache of every host-placed pack of a module.

    Attributes:
        fraction: The cache's rows as a share of the pack's rows (``model.cache_fraction``).
        rows: Rows of the cache per pack; > 0 overrides ``fraction`` (``model.cache_rows``).
        policy: ``"lru"`` or ``"lfu"``: the order in which unlocked slots are reused
            (``model.cache_policy``; see :mod:`recaccel.ops.embedding.cache.policy`).
        window: How many training batches' rows are locked at once: the batch being
            prepared and the ``window - 1`` prepared before it (a batch's rows are
            released when the ``window``-th newer training batch is prepared). Set it to
            ``model.cache_lookahead`` plus the pipeline's batches in flight; a batch
            trained after its release is made resident again (exact, slower).

    Raises:
        ConfigError: a value out of range, naming its ``model.cache_*`` key.
    """

    fraction: float = 0.1
    rows: int = 0
    policy: CachePolicy = "lru"
    window: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"model.cache_fraction must be in (0, 1], got {self.fraction}")
        if int(self.rows) != self.rows or self.rows < 0:
            raise ConfigError(f"model.cache_rows must be an integer >= 0, got {self.rows}")
        if self.policy not in POLICIES:
            raise ConfigError(f"model.cache_policy must be one of {POLICIES}, got {self.policy!r}")
        if int(self.window) != self.window or self.window < 1:
            raise ConfigError(
                f"the cache window (model.cache_lookahead + batches in flight) must be >= 1, got {self.window}"
            )

    def capacity(self, num_rows: int) -> int:
        """Slots of the cache of a pack of ``num_rows`` rows: ``rows`` (or ``ceil(fraction * R)``),
        at least 1 and at most ``num_rows``."""
        want = int(self.rows) if self.rows > 0 else math.ceil(self.fraction * num_rows)
        return max(1, min(want, num_rows))


def check_host_placement(layouts: list, backend: str, mode: str, dtype: str) -> None:
    """Refuses host-placed packs under options the cache cannot serve.

    Args:
        layouts: The host-placed packs' layouts.
        backend: The module's resolved backend.
        mode: ``"fused"`` or ``"autograd"``.
        dtype: The rows' dtype name.

    Raises:
        ConfigError: autograd mode, the fbgemm backend, or 16-bit rows (one line).
    """
    names = [t.name for layout in layouts for t in layout.tables]
    where = f"PackedEmbeddingBag: tables {names} are placed on the host (model.embedding_placement / table_placement)"
    if mode != "fused":
        raise ConfigError(
            f"{where}, which needs mode='fused' (the cache updates rows in the fused backward), got {mode!r}"
        )
    if backend == "fbgemm":
        raise ConfigError(
            f"{where}, which the fbgemm backend does not support; use model.embedding_backend = 'auto'"
        )
    if dtype != "fp32":
        raise ConfigError(
            f"{where}, which needs float32 rows (model.embedding_dtype = 'fp32'), got {dtype!r}"
        )
