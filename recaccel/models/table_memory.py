"""Refusing embedding tables that cannot fit, before anything is allocated.

A schema declares each sparse field's cardinality; a damaged or hostile file can declare
10^12 rows, which would otherwise fail deep inside an allocation (or swap the host to a
halt). The model factory checks the tables' bytes against the memory where they will live.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from recaccel.errors import DataError

if TYPE_CHECKING:  # only read by attribute: models do not depend on io at run time
    from recaccel.io.format.schema import FeatureSchema


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes (0 if the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def device_memory_bytes(device: torch.device | str) -> int:
    """Memory that tables on ``device`` can use: the GPU's total for CUDA, else the
    host's physical memory (0 = unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    if device.type == "meta":
        return 0
    return host_memory_bytes()


def table_memory_bytes(schema: FeatureSchema, dim: int, bytes_per_value: int = 4) -> int:
    """Bytes of the embedding weights of every sparse field: sum(cardinality) * dim * size.

    A lower bound of what training needs (optimizer state and gradients come on top).
    """
    return sum(schema.cardinalities) * int(dim) * int(bytes_per_value)


def check_table_memory(
    schema: FeatureSchema,
    dim: int,
    device: torch.device | str,
    *,
    bytes_per_value: int = 4,
    limit_bytes: int | None = None,
) -> None:
    """Refuses a schema whose embedding tables cannot fit, before anything is allocated.

    Args:
        schema: the dataset schema (its :attr:`~FeatureSchema.origin` is the file named).
        dim: D, the embedding dim.
        device: where the tables will live.
        bytes_per_value: size of one weight (4 for float32).
        limit_bytes: a configured budget; None = the device's memory (see
            :func:`device_memory_bytes`).

    Raises:
        DataError: naming the file, the bytes needed, the budget and the largest fields.
    """
    need = table_memory_bytes(schema, dim, bytes_per_value)
    budget = limit_bytes if limit_bytes is not None else device_memory_bytes(device)
    if budget <= 0 or need <= budget:
        return
    largest = sorted(schema.sparse, key=lambda f: -f.cardinality)[:3]
    shown = ", ".join(f"{f.name!r}: {f.cardinality} ids" for f in largest)
    what = "the configured limit" if limit_bytes is not None else f"the memory of {torch.device(device)}"
    raise DataError(
        f"the embedding tables of the schema need {_bytes(need)} ({need} bytes: "
        f"{sum(schema.cardinalities)} rows x dim {dim} x {bytes_per_value} bytes) "
        f"but {what} is {_bytes(budget)} ({budget} bytes); "
        f"largest fields {shown}",
        path=schema.origin,
    )


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
