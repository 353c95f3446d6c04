"""SplitMix64, the one integer hash of recaccel (io converters, task splits, ops' id hashing).

SplitMix64 (Steele, Lea and Flood, 2014) steps a 64-bit state by the odd constant
:data:`GAMMA` and passes it through a finalizer, a bijection of 64-bit words that mixes
every input bit into every output bit:

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >> 31)

all modulo 2**64 with logical (unsigned) shifts. :func:`mix64` is the finalizer on numpy
uint64 arrays, :func:`mix64_int64` the same on the 64 two's-complement bits of torch
int64 tensors (torch has no uint64 arithmetic), and :func:`splitmix64_63` is the id hash
of :func:`recaccel.ops.field_ops.map_ids`: ``mix64(id + GAMMA) >> 1``, a non-negative
int64. The Triton kernel of that op takes its constants from here.

This module sits at the bottom of the package graph: it imports only numpy and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: numpy users (io) need not import torch
    from torch import Tensor

__all__ = [
    "GAMMA",
    "MIX1",
    "MIX2",
    "SHIFT1",
    "SHIFT2",
    "SHIFT3",
    "as_int64",
    "mix64",
    "mix64_int64",
    "splitmix64_63",
]

GAMMA = 0x9E3779B97F4A7C15  # the state increment: 2**64 / golden ratio, made odd
MIX1 = 0xBF58476D1CE4E5B9  # the finalizer's first multiplier
MIX2 = 0x94D049BB133111EB  # the finalizer's second multiplier
SHIFT1, SHIFT2, SHIFT3 = 30, 27, 31  # the finalizer's xor-shifts, in order


def as_int64(value: int) -> int:
    """The signed int64 with the same 64 bits as the unsigned ``value`` in [0, 2**64)."""
    return value - 2**64 if value >= 2**63 else value


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on numpy words: uint64 [n] (or anything castable) -> uint64 [n]."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> np.uint64(SHIFT1))) * np.uint64(MIX1)
    x = (x ^ (x >> np.uint64(SHIFT2))) * np.uint64(MIX2)
    return x ^ (x >> np.uint64(SHIFT3))


def _logical_shift_right(z: Tensor, k: int) -> Tensor:
    """Unsigned ``z >> k`` on int64 bits (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64_int64(z: Tensor) -> Tensor:
    """SplitMix64 finalizer on int64 [N] tensors read as 64-bit words -> int64 [N] (same bits
    as :func:`mix64` of the words; int64 multiplication wraps modulo 2**64 as uint64 would)."""
    z = (z ^ _logical_shift_right(z, SHIFT1)) * as_int64(MIX1)
    z = (z ^ _logical_shift_right(z, SHIFT2)) * as_int64(MIX2)
    return z ^ _logical_shift_right(z, SHIFT3)


def splitmix64_63(ids: Tensor) -> Tensor:
    """``mix64(id + GAMMA) >> 1`` on int64 [N] ids (their two's-complement bits) ->
    non-negative int64 [N]: the id hash of :func:`recaccel.ops.field_ops.map_ids`."""
    return _logical_shift_right(mix64_int64(ids + as_int64(GAMMA)), 1)
