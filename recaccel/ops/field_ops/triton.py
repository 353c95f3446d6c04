"""Triton kernels for the packed per-field ops (see :mod:`recaccel.ops.field_ops`).

``map_ids``: one program per block of ids; each id finds its field by binary search over
the F+1 field starts ``offsets[f*B]`` (a few cached loads, no per-id index tensor), then
reads that field's row of the parameter table. Hashing runs in uint64, whose
multiplication and logical shifts are exactly SplitMix64's.

``dense_transform``: one program per [BLOCK_B, BLOCK_C] tile, per-column parameters
loaded once per tile. ``log1p`` uses ``log(u) * x / (u - 1)`` with ``u = 1 + x`` for
x < 1 (Goldberg's trick: accurate to a few ulp, and runs under the interpreter, which
lacks libdevice's log1p), plain ``log(1 + x)`` above.

Whether kernels are interpreted is fixed when this module is imported: set
``TRITON_INTERPRET=1`` before then to run them on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel import hashing
from recaccel.ops.backend import check_triton_launchable
from recaccel.ops.field_ops.params import (
    DENSE_TRITON_DTYPES,
    MODE_HASH,
    OP_LOG1P,
    DenseTransformParams,
    FieldIdParams,
)

_MAP_BLOCK = 1024
_DENSE_BLOCK_B = 32
_DENSE_BLOCK_C = 32
# SplitMix64 (recaccel.hashing) as kernel constants; GAMMA and the multipliers exceed
# int64, so they enter the uint64 arithmetic as uint64, as literals would.
_GAMMA = tl.constexpr(hashing.GAMMA)
_MIX1 = tl.constexpr(hashing.MIX1)
_MIX2 = tl.constexpr(hashing.MIX2)
_SHIFT1 = tl.constexpr(hashing.SHIFT1)
_SHIFT2 = tl.constexpr(hashing.SHIFT2)
_SHIFT3 = tl.constexpr(hashing.SHIFT3)


@triton.jit
def _splitmix64_63(x):
    """splitmix64 of int64 bits, shifted right once -> non-negative int64."""
    z = x.to(tl.uint64, bitcast=True) + _GAMMA
    z = (z ^ (z >> _SHIFT1)) * _MIX1
    z = (z ^ (z >> _SHIFT2)) * _MIX2
    z = z ^ (z >> _SHIFT3)
    return (z >> 1).to(tl.int64, bitcast=True)


@triton.jit
def _map_ids_kernel(
    values_ptr,
    starts_ptr,
    mode_ptr,
    card_ptr,
    row_offset_ptr,
    out_ptr,
    N,
    F,
    SEARCH_STEPS: tl.constexpr,
    HASH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < N
    # Largest f in [0, F) with starts[f] <= i: the field whose id range holds i
    # (empty fields share a start with the next one and lose to it).
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + F
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(starts_ptr + mid) <= i
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    field = lo
    mode = tl.load(mode_ptr + field)
    card = tl.load(card_ptr + field)
    row_offset = tl.load(row_offset_ptr + field)
    x = tl.load(values_ptr + i, mask=valid, other=0)
    modulo = x % card
    modulo = tl.where(modulo < 0, modulo + card, modulo)  # C-style % -> Python-style
    hashed = _splitmix64_63(x) % card
    row = tl.where(mode == HASH, hashed, modulo) + row_offset
    tl.store(out_ptr + i, row, mask=valid)


@triton.jit
def _dense_transform_kernel(
    x_ptr,
    out_ptr,
    op_ptr,
    lo_ptr,
    hi_ptr,
    B,
    C,
    stride_xb,
    stride_xc,
    LOG1P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    mask = (rows < B)[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xb + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    op = tl.load(op_ptr + cols, mask=cm, other=0)
    lo = tl.load(lo_ptr + cols, mask=cm, other=0.0)
    hi = tl.load(hi_ptr + cols, mask=cm, other=0.0)
    pos = tl.where(x > 0.0, x, 0.0)
    # Below 1, correct log(1 + x)'s rounding of u; above, log(u) is already accurate.
    small = tl.where(pos < 1.0, pos, 0.0)
    u = 1.0 + small
    u_minus_1 = tl.where(u == 1.0, 1.0, u - 1.0)
    log1p = tl.where(u == 1.0, small, tl.log(u) * (small / u_minus_1))
    log1p = tl.where(pos < 1.0, log1p, tl.log(1.0 + pos))
    y = tl.where((op == LOG1P)[None, :], log1p, x)
    y = tl.minimum(tl.maximum(y, lo[None, :]), hi[None, :])
    y = tl.where(x != x, x, y)  # noqa: PLR0124  NaN in, NaN out (GPU min/max would drop it)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def map_ids_triton(values: Tensor, offsets: Tensor, params: FieldIdParams) -> Tensor:
    """Triton :func:`recaccel.ops.field_ops.map_ids` (inputs already validated).

    Args:
        values: int64 [N] raw ids.
        offsets: int64 [F*B+1] field-major CSR offsets.
        params: per-field parameters on the same device.

    Returns:
        int64 [N] packed row indices.
    """
    check_triton_launchable(_map_ids_kernel, values.device, "map_ids")
    n, f = values.numel(), params.num_fields
    out = torch.empty(n, dtype=torch.int64, device=values.device)
    if n == 0:
        return out
    b = (offsets.numel() - 1) // f
    starts = offsets[::b].contiguous()  # [F+1]: offsets[f*B]
    steps = max(1, (f - 1).bit_length())  # ceil(log2(F)) halvings of [0, F)
    grid = (triton.cdiv(n, _MAP_BLOCK),)
    _map_ids_kernel[grid](
        values.contiguous(), starts, params.mode, params.cardinality, params.row_offset, out, n, f,
        SEARCH_STEPS=steps, HASH=MODE_HASH, BLOCK=_MAP_BLOCK,
    )  # fmt: skip
    return out


def dense_transform_triton(x: Tensor, params: DenseTransformParams) -> Tensor:
    """Triton :func:`recaccel.ops.field_ops.dense_transform` (inputs already validated).

    Args:
        x: [B, Dd] float32, float16 or bfloat16.
        params: per-column parameters on the same device.

    Returns:
        [B, Dd] in ``x``'s dtype, contiguous.
    """
    check_triton_launchable(_dense_transform_kernel, x.device, "dense_transform")
    if x.dtype not in DENSE_TRITON_DTYPES:
        raise ValueError(f"dense_transform: the triton backend supports {DENSE_TRITON_DTYPES}, got {x.dtype}")
    b, c = x.shape
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(b, _DENSE_BLOCK_B), triton.cdiv(c, _DENSE_BLOCK_C))
    _dense_transform_kernel[grid](
        x, out, params.op, params.clip_min, params.clip_max, b, c, x.stride(0), x.stride(1),
        LOG1P=OP_LOG1P, BLOCK_B=_DENSE_BLOCK_B, BLOCK_C=_DENSE_BLOCK_C,
    )  # fmt: skip
    return out
