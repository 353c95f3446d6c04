"""Launch plans of the Triton dot-interaction kernels: tile sizes by shape, tuned per device.

A plan fixes the row tile BT (by R alone; a tuned entry may pick another on the tile-pair
grid) and, per kernel, the batch rows per program, the column chunk and the warps:
:func:`heuristic_plan` from register budgets, replaced per shape by the tuning table's
entries for the device (:func:`launch_plan`, :mod:`recaccel.ops.interaction.tuning`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from recaccel.errors import ConfigError
from recaccel.ops.interaction import tuning
from recaccel.ops.tf32 import tf32_enabled
from recaccel.ops.tuning_tables import check_entry

_OP = "dot_interaction"
ONE_TILE_MAX_ROWS = 64  # up to here one row tile holds all R rows; beyond, the tile-pair grid


def dot_precision(dtype: torch.dtype, *, on_cuda: bool, allow_tf32: bool) -> str:
    """How the interaction's ``tl.dot`` multiplies operands of ``dtype``.

    Args:
        dtype: Input dtype (float32, bfloat16 or float16).
        on_cuda: True when the kernels run compiled on a GPU, False under the interpreter.
        allow_tf32: torch's TF32 switch (:func:`recaccel.ops.tf32.tf32_enabled`).

    Returns:
        ``"native"`` (16-bit tensor-core products, exact in the float32 accumulator),
        ``"tf32"``, ``"tf32x3"`` (three TF32 products: float32 accuracy on tensor cores) or,
        off CUDA only, ``"ieee"`` (what the interpreter runs). Never ``"ieee"`` on CUDA.
    """
    if not on_cuda:
        return "ieee"
    if dtype != torch.float32:
        return "native"
    return "tf32" if allow_tf32 else "tf32x3"


class KernelConfig(NamedTuple):
    """One kernel's launch configuration: what the tuning table stores per shape."""

    block_b: int  # batch rows per program (a power of two)
    bd: int  # column chunk (a power of two >= 16); the backward's grid covers the chunks
    num_warps: int
    # Row tile of the tile-pair grid (R > 64): a power of two in 16..64, or 0 for
    # :func:`row_tile`'s 64. On sm_90 (sm90_report, R=501 D=32 bf16) the 64-row backward
    # tile takes 244-255 registers (8 warps an SM) where 32 rows take 127-155 (12-16
    # warps) and 16 rows 64-72 (28-32 warps): more loads in flight for the triangle's
    # unaligned (scalar) gradient loads, against more re-reads of x from L2.
    bt: int = 0


def tile_rows(config: KernelConfig, num_rows: int) -> int:
    """The row tile BT ``config`` launches with at R = ``num_rows``."""
    return config.bt or row_tile(num_rows)


class LaunchPlan(NamedTuple):
    """Compile-time shape of the forward and backward launches at one (R, D)."""

    bt: int  # the heuristic's row tile (a kernel config's own ``bt`` replaces it: :func:`tile_rows`)
    nt: int  # row tiles at ``bt``
    fwd: KernelConfig
    bwd: KernelConfig


def row_tile(num_rows: int) -> int:
    """BT for R rows: one power-of-two tile (>= 16, ``tl.dot``'s minimum) up to
    :data:`ONE_TILE_MAX_ROWS` rows, else 64-row tiles over a grid of tile pairs."""
    return max(16, triton.next_power_of_2(num_rows)) if num_rows <= ONE_TILE_MAX_ROWS else 64


def heuristic_plan(num_rows: int, dim: int) -> LaunchPlan:
    """Tile sizes for R rows of dim D: register tiles of at most 4096 elements per operand.

    Checked with ``../shared/tools/sm90_report.py`` for R=27, D=128 (sm_90, 4 warps): the
    forward issues ``mma`` with no spills in every mode; the backward at BLOCK_B=2, BD=64
    has no spills even in tf32x3 (BD=128 spilled 112 bytes there). R=501, D=32 (64-row
    tiles): 8 warps, no spills in the backward; the tf32x3 forward spills 84 bytes (4 warps:
    120). On the H200 (2026-11-26) the R=27 D=128 float32 forward ran at 29-30% of the
    copy bandwidth: ``recaccel-bench interaction_tune`` times the alternatives. Its R=27
    D=128 bf16 forward candidates (block_b, bd, warps) = (2, 64, 4) [this default],
    (4, 64, 4), (1, 128, 4), (8, 32, 8), (4, 32, 4) compile with 84-126 registers, no
    spills, 16-32 ``mma`` and the tile loads as ``cp.async``; the triangle's stores are
    scalar (its columns are not 16-byte aligned).
    """
    one_tile = num_rows <= ONE_TILE_MAX_ROWS
    bt = row_tile(num_rows)
    bd = min(max(16, triton.next_power_of_2(dim)), 64)
    block_b = max(1, min(8, 4096 // (bt * bd))) if one_tile else 1
    warps_fwd = 4 if one_tile and block_b * bt * max(bt, bd) <= 4096 else 8
    warps_bwd = 4 if one_tile and block_b * bt * bd <= 4096 else 8
    nt = triton.cdiv(num_rows, bt)
    return LaunchPlan(bt, nt, KernelConfig(block_b, bd, warps_fwd), KernelConfig(block_b, bd, warps_bwd))


def check_config(config: KernelConfig, num_rows: int) -> None:
    """Raises ValueError unless ``config`` can launch at R = ``num_rows`` (powers of two;
    several batch rows per program only where one row tile holds every row; a row tile of
    its own only on the tile-pair grid, R > 64)."""
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in config[:3])
    pairs = num_rows > ONE_TILE_MAX_ROWS
    bt_ok = config.bt == 0 or (pairs and config.bt in (16, 32, 64))
    if not pow2 or config.bd < 16 or (config.block_b > 1 and pairs) or not bt_ok:
        raise ValueError(f"{_OP}: launch config {config._asdict()} cannot run at R={num_rows}")


def launch_plan(num_rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> LaunchPlan:
    """:func:`heuristic_plan` with the tuning table's configs for ``device`` where it has
    this shape (:mod:`recaccel.ops.interaction.tuning`); CUDA only (nobody tunes the
    interpreter)."""
    plan = heuristic_plan(num_rows, dim)
    if device.type != "cuda":
        return plan
    mode = dot_precision(dtype, on_cuda=True, allow_tf32=tf32_enabled())
    keys = {k: tuning.shape_key(k, num_rows, dim, dtype, mode) for k in ("fwd", "bwd")}
    tuned = with_tuned(plan, **{k: tuning.lookup(device, key) for k, key in keys.items()})
    for kernel, key in keys.items():
        try:
            check_config(getattr(tuned, kernel), num_rows)
        except ValueError as e:  # a hand-edited table: one line at the lookup, not at every launch
            raise ConfigError(f"{_OP} tuning table: {key}: {e}") from None
    return tuned


def with_tuned(plan: LaunchPlan, fwd: dict[str, int] | None, bwd: dict[str, int] | None) -> LaunchPlan:
    """``plan`` with each kernel's config replaced by its table entry, where there is one.

    Raises:
        ConfigError: an entry lacks a field, has another, or one that is not an integer (a
            hand-edited table): one line naming the kernel and the entry.
    """
    tuned = {}
    for kernel, entry in (("fwd", fwd), ("bwd", bwd)):
        if entry is not None:
            check_entry(entry, KernelConfig._fields[:3], ("bt",), name=f"{_OP} tuning table: {kernel} entry")
            tuned[kernel] = KernelConfig(**entry)
    return plan._replace(**tuned)
