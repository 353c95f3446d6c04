"""Packed per-field ops: raw-id mapping into a packed table, per-column dense transforms.

Like the packed embedding, one kernel serves every field (or column), driven by a small
per-field parameter table, instead of one small op per field.

``map_ids``: the ids of field f become rows ``row_offset[f] + m(id)`` of a packed
table, where ``m`` is, per field,

- ``modulo``: ``id mod cardinality``, non-negative (Python's ``%``), so ``-1`` maps to
  ``cardinality - 1``;
- ``hash``: ``(splitmix64(id) >> 1) mod cardinality``, where ``splitmix64`` is the
  output function of Steele et al.'s SplitMix64 generator on the id's 64 two's-complement
  bits: ``z = id + 0x9E3779B97F4A7C15``; ``z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9``;
  ``z = (z ^ (z >> 27)) * 0x94D049BB133111EB``; ``z ^ (z >> 31)``, all modulo 2**64
  with logical shifts (:mod:`recaccel.hashing`). Dropping the low bit leaves a
  non-negative int64.

``dense_transform``: column c of [B, Dd] becomes ``clamp(op_c(x), clip_min[c],
clip_max[c])`` with ``op`` one of ``identity``, ``log1p`` (``log(1 + max(x, 0))``, the
Criteo convention) or ``clip`` (identity; a name for columns that only clamp). NaN
propagates: a NaN input gives NaN whatever the column's op and bounds.

Backends: ``reference`` (PyTorch) and ``triton`` (:mod:`recaccel.ops.field_ops.triton`).
"""

from __future__ import annotations

from torch import Tensor

from recaccel.hashing import splitmix64_63
from recaccel.ops.backend import BACKENDS, resolve_backend
from recaccel.ops.field_ops.params import (
    DENSE_OPS,
    DENSE_TRITON_DTYPES,
    ID_MODES,
    MODE_HASH,
    MODE_MODULO,
    OP_CLIP,
    OP_IDENTITY,
    OP_LOG1P,
    DenseTransformParams,
    FieldIdParams,
    check_dense_inputs,
    check_map_ids_inputs,
)
from recaccel.ops.field_ops.reference import dense_transform_reference, field_of_ids, map_ids_reference

__all__ = [
    "DENSE_OPS",
    "DENSE_TRITON_DTYPES",
    "ID_MODES",
    "MODE_HASH",
    "MODE_MODULO",
    "OP_CLIP",
    "OP_IDENTITY",
    "OP_LOG1P",
    "DenseTransformParams",
    "FieldIdParams",
    "dense_transform",
    "dense_transform_reference",
    "field_of_ids",
    "map_ids",
    "map_ids_reference",
    "splitmix64_63",
]

_BACKENDS = tuple(b for b in BACKENDS if b != "fbgemm")  # reference, triton


def map_ids(values: Tensor, offsets: Tensor, params: FieldIdParams, backend: str = "auto") -> Tensor:
    """Maps raw ids of every field to rows of one packed table, in one pass.

    Args:
        values: int64 [N] raw ids (any int64, negative too), field-major CSR.
        offsets: int64 [F*B+1] bag offsets, from 0 to N (``SparseFeatures`` layout).
        params: per-field mode, cardinality and row offset (F fields), on the ids' device.
        backend: ``"auto"`` (triton on CUDA, else reference), ``"reference"`` or ``"triton"``.

    Returns:
        int64 [N] packed row indices; field f's land in ``[row_offset[f], row_offset[f] + cardinality[f])``.

    Raises:
        ValueError: bad shapes, dtypes, devices or offsets (offsets' ends checked on CPU only).
    """
    check_map_ids_inputs(values, offsets, params)
    name = resolve_backend(backend, values.device, available=_BACKENDS, op="map_ids")
    if name == "reference":
        return map_ids_reference(values, offsets, params)
    from recaccel.ops.field_ops import triton as field_ops_triton

    return field_ops_triton.map_ids_triton(values, offsets, params)


def dense_transform(x: Tensor, params: DenseTransformParams, backend: str = "auto") -> Tensor:
    """Applies each column's transform and clip range, all columns in one pass.

    Args:
        x: [B, Dd] float32 (float16/bfloat16 work too; math runs in float32).
        params: per-column op and clip bounds (Dd columns), on ``x``'s device.
        backend: ``"auto"`` (triton on CUDA for :data:`DENSE_TRITON_DTYPES`, else
            reference), ``"reference"`` or ``"triton"``.

    Returns:
        [B, Dd] in ``x``'s dtype; NaN where ``x`` is NaN.

    Raises:
        ValueError: bad shape, dtype or device.
    """
    check_dense_inputs(x, params)
    name = resolve_backend(backend, x.device, available=_BACKENDS, op="dense_transform")
    if name == "reference" or (backend == "auto" and x.dtype not in DENSE_TRITON_DTYPES):
        return dense_transform_reference(x, params)
    from recaccel.ops.field_ops import triton as field_ops_triton

    return field_ops_triton.dense_transform_triton(x, params)
