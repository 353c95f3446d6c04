"""Which Triton backward runs, and how: the occurrence tiles' and the piece lanes' launch
configurations, from the per-device tuning table or the default.

:func:`tile_config` reads the table (:mod:`~recaccel.ops.embedding.triton.tuning`): an
entry with ``piece_len`` is a :class:`~recaccel.ops.embedding.triton.piece_lanes.LaneConfig`,
any other a :class:`TileConfig`; :func:`resolve_config` lets a caller name either.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple

import torch
import triton

from recaccel.errors import ConfigError
from recaccel.ops.embedding.triton import tuning
from recaccel.ops.embedding.triton.piece_lanes import LaneConfig
from recaccel.ops.tuning_tables import check_entry

logger = logging.getLogger(__name__)


class TileConfig(NamedTuple):
    """Launch configuration of the occurrence-tile kernel.

    Attributes:
        block_occ: Occurrences per chunk (the scan's length).
        num_warps: Warps per program.
        subtiles: Chunks one program walks in order (its span is ``block_occ * subtiles``).
    """

    block_occ: int
    num_warps: int
    subtiles: int = 1


BackwardConfig = TileConfig | LaneConfig


MAX_DENSITY_BUCKET = 32


def density_bucket(num_occ: int, num_rows: int) -> int:
    """A pack's occurrences per row, rounded up to a power of two in 1 .. 32: the backward
    key's bucket (both counts are known on the host). Few occurrences per row (one-hot ids
    into large tables) leave most rows alone in their run; many (long bags into small
    tables) make long runs, where walking a row's occurrences in order pays.

    A proxy, not the runs' length (that needs the unique rows: a host synchronisation):
    skewed ids into a large table give bucket 1 and still a few rows with tens of
    thousands of occurrences; both kernels split such rows over many programs.
    """
    per_row = math.ceil(num_occ / max(num_rows, 1))
    return min(triton.next_power_of_2(max(1, per_row)), MAX_DENSITY_BUCKET)


def tile_config(
    dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    density: int | None = None,
) -> BackwardConfig:
    """The backward's launch configuration for rows of ``dim`` columns in ``dtype``: the
    per-device tuning table's entry for ``device``
    (:mod:`~recaccel.ops.embedding.triton.tuning`) at the ``density`` bucket
    (:func:`density_bucket`), else its entry without a bucket: piece lanes
    (:mod:`~recaccel.ops.embedding.triton.piece_lanes`) where the entry has
    ``piece_len``, else occurrence tiles (an entry without ``subtiles`` has 1); without
    an entry, the occurrence tiles' default below (one chunk per program).

    A chunk holds ``BLOCK_OCC x next_pow2(D)`` float32 values and as many scan flags in
    registers: 2048 of each compiles (sm_90, 4 warps) to ~76-142 registers per thread,
    no spills, 3-6 programs per SM, 16-byte gradient loads when D is a multiple of 4;
    4096 takes 191-255 registers (more chunks per program: see the module's table). The
    configuration fixes the summation order, hence the bits of the result; the tuning
    run may replace this default per device.
    """
    if device is not None:
        key = None if density is None else tuning.backward_key(dim, dtype, density)
        entry = None if key is None else tuning.lookup(device, key)
        if entry is None:
            key = tuning.backward_key(dim, dtype)
            entry = tuning.lookup(device, key)
        if entry is not None:
            return config_of_entry(entry, key)
    block_d = triton.next_power_of_2(dim)
    return TileConfig(max(8, min(128, 2048 // block_d)), 4)


def config_of_entry(entry: dict[str, int], key: str) -> BackwardConfig:
    """A tuning-table entry's launch configuration: piece lanes where it has ``piece_len``
    (exactly their four fields), else occurrence tiles (``block_occ``, ``num_warps`` and
    an optional ``subtiles``, 1 when absent).

    Raises:
        ConfigError: the entry lacks a field, has another, or one that is not an integer
            (a hand-edited table), named with its key.
    """
    lanes = "piece_len" in entry
    kind = "piece-lane" if lanes else "occurrence-tile"
    required = LaneConfig._fields if lanes else ("block_occ", "num_warps")
    check_entry(
        entry, required, () if lanes else ("subtiles",), name=f"embedding tuning table: {kind} entry {key!r}"
    )
    if lanes:
        return LaneConfig(**entry)
    return TileConfig(entry["block_occ"], entry["num_warps"], entry.get("subtiles", 1))


def resolve_config(
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    config: BackwardConfig | None,
    block_occ: int | None,
    num_warps: int | None,
    subtiles: int | None,
    density: int | None = None,
) -> BackwardConfig:
    """``config`` when given; else occurrence tiles when any of their fields is given (the
    others from :func:`tile_config`'s tile default); else :func:`tile_config` at ``density``."""
    if config is not None:
        return config
    if block_occ is None and num_warps is None and subtiles is None:
        return tile_config(dim, dtype, device, density)
    tuned = tile_config(dim, dtype, device, density)
    base = tuned if isinstance(tuned, TileConfig) else tile_config(dim)
    return TileConfig(
        base.block_occ if block_occ is None else block_occ,
        base.num_warps if num_warps is None else num_warps,
        base.subtiles if subtiles is None else subtiles,
    )


def check_tile_config(block_occ: int, subtiles: int) -> None:
    """One line naming the values when the kernel cannot take them (a hand-edited table)."""
    if block_occ < 1 or block_occ & (block_occ - 1) or subtiles < 1:
        raise ConfigError(
            f"occurrence-tile backward: block_occ={block_occ}, subtiles={subtiles}: "
            "block_occ must be a power of two and subtiles at least 1"
        )


@functools.lru_cache(maxsize=64)
def log_choice(dim: int, dtype: torch.dtype, density: int | None, config: BackwardConfig) -> None:
    """Logs once per shape which backward kernel and configuration the updates run (a
    benchmark's log then says what its step timed)."""
    kernel = "piece lanes" if isinstance(config, LaneConfig) else "occurrence tiles"
    logger.info(
        "embedding backward: %s %s for D=%d %s rows, %s occurrences per row",
        kernel, dict(config._asdict()), dim, str(dtype).removeprefix("torch."),
        "any" if density is None else f"<= {density}",
    )  # fmt: skip
