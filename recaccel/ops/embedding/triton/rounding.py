"""Stochastic rounding inside Triton kernels: the device side of
:mod:`recaccel.ops.embedding.rounding`, bit for bit (the same hash, the same rule), so the
16-bit rows a fused update writes do not depend on the backend.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _uniform_noise(seed, index):
    """Uniform float32 in [0, 1): :func:`recaccel.ops.embedding.rounding.uniform_noise`, bit for bit."""
    h = (index & 0xFFFFFFFF) ^ seed
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2^-24


@triton.jit
def _stochastic_round(x, noise, dtype: tl.constexpr):
    """Rounds float32 ``x`` to the 16-bit ``dtype``: to the neighbour further from zero with
    probability (|x| - lo) / (hi - lo), as :func:`recaccel.ops.embedding.rounding.stochastic_round`."""
    nearest = x.to(dtype)
    near = nearest.to(tl.float32)
    up = tl.abs(x) > tl.abs(near)
    step = tl.where(up, 1, -1).to(tl.int16)
    other = (nearest.to(tl.int16, bitcast=True) + step).to(dtype, bitcast=True)
    far = other.to(tl.float32)
    lo = tl.where(up, near, far)
    hi = tl.where(up, far, near)
    pick_hi = noise < (x - lo) / (hi - lo)
    rounded = tl.where(pick_hi == up, other, nearest)
    return tl.where((near == x) | (x != x), nearest, rounded)
