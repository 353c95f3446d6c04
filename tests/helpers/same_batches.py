"""Bit-for-bit comparison of batch streams (every tensor: dtype, shape and values)."""

from __future__ import annotations

import dataclasses

import torch


def tensors(value) -> list:
    """Every tensor of a Batch (None fields as None), in field order."""
    if isinstance(value, torch.Tensor) or value is None:
        return [value]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in tensors(getattr(value, f.name))]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in tensors(value[k])]
    return []


def assert_same_batches(a: list, b: list) -> None:
    """``a`` and ``b`` are equally long, non-empty and equal tensor by tensor (torch.equal)."""
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        tx, ty = tensors(x), tensors(y)
        assert len(tx) == len(ty)
        for u, v in zip(tx, ty, strict=True):
            assert (u is None) == (v is None)
            if u is not None:
                assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v)
