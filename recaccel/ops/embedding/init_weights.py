"""The initial rows of a packed embedding bag's tables: the same on every backend and device."""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.ops.embedding.specs import TableSpec

_OP = "PackedEmbeddingBag"


def init_table_weights(
    tables: list[TableSpec], seed: int | None = None, generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Initial rows of each table: uniform(-1/sqrt(R), 1/sqrt(R)), drawn on the CPU in table order.

    The same tables, seed (or CPU generator state) give the same rows whatever the
    backend and device.
    """
    if seed is not None and generator is not None:
        raise ConfigError(f"{_OP}: pass seed or generator, not both")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    out = {}
    for t in tables:
        bound = t.num_rows**-0.5
        out[t.name] = torch.empty(t.num_rows, t.dim).uniform_(-bound, bound, generator=generator)
    return out


def rounding_seed(seed: int | None, generator: torch.Generator | None) -> int:
    """Seed of a module's stochastic rounding: from ``seed``, else one draw from ``generator``
    (torch's global generator when None), after the initial rows were drawn."""
    if seed is not None:
        return seed
    return int(torch.randint(0, 2**62, (), generator=generator))
