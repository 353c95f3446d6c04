"""The packed per-field ops in plain PyTorch: the specification the Triton kernels match.

See :mod:`recaccel.ops.field_ops` for the definitions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.hashing import splitmix64_63
from recaccel.ops.field_ops.params import (
    MODE_HASH,
    OP_LOG1P,
    DenseTransformParams,
    FieldIdParams,
    check_dense_inputs,
    check_map_ids_inputs,
)


def field_of_ids(offsets: Tensor, num_fields: int, num_ids: int) -> Tensor:
    """Field index (int64 [N]) of every id of a field-major CSR batch."""
    b = (offsets.numel() - 1) // num_fields
    if num_ids == 0:
        return torch.zeros(0, dtype=torch.int64, device=offsets.device)
    starts = offsets[:: max(b, 1)][: num_fields + 1]  # offsets[f*B]: where field f's ids begin
    counts = starts[1:] - starts[:-1]
    fields = torch.arange(num_fields, device=offsets.device)
    return torch.repeat_interleave(fields, counts, output_size=num_ids)


def map_ids_reference(values: Tensor, offsets: Tensor, params: FieldIdParams) -> Tensor:
    """:func:`~recaccel.ops.field_ops.map_ids` in plain PyTorch (the specification)."""
    check_map_ids_inputs(values, offsets, params)
    field = field_of_ids(offsets, params.num_fields, values.numel())
    card = params.cardinality[field]
    modulo = torch.remainder(values, card)  # Python-style: non-negative for card > 0
    hashed = torch.remainder(splitmix64_63(values), card)
    row = torch.where(params.mode[field] == MODE_HASH, hashed, modulo)
    return row + params.row_offset[field]


def dense_transform_reference(x: Tensor, params: DenseTransformParams) -> Tensor:
    """:func:`~recaccel.ops.field_ops.dense_transform` in plain PyTorch (the specification)."""
    check_dense_inputs(x, params)
    xf = x.float()
    log1p = torch.log1p(torch.clamp_min(xf, 0.0))  # clamp_min keeps NaN
    y = torch.where(params.op == OP_LOG1P, log1p, xf)
    y = torch.minimum(torch.maximum(y, params.clip_min), params.clip_max)  # both propagate NaN
    return y.to(x.dtype)
