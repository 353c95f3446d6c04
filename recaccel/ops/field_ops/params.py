"""The inputs of the packed per-field ops: per-field parameters, their codes and checks.

Shared by the dispatch (:mod:`recaccel.ops.field_ops`), the reference and the Triton
kernels. Shapes: F fields, B batch, N ids, Dd dense columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.errors import ConfigError

ID_MODES = ("modulo", "hash")
DENSE_OPS = ("identity", "log1p", "clip")
MODE_MODULO, MODE_HASH = 0, 1
OP_IDENTITY, OP_LOG1P, OP_CLIP = 0, 1, 2

DENSE_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT64_MAX = 2**63 - 1


def _per_field(value, num: int, what: str) -> list:
    """A scalar broadcast to ``num`` entries, or a sequence checked to have ``num``."""
    if isinstance(value, (str, int, float)):
        return [value] * num
    value = list(value)
    if len(value) != num:
        raise ConfigError(f"{what} has {len(value)} entries, expected {num}")
    return value


@dataclass(frozen=True)
class FieldIdParams:
    """Per-field id-mapping parameters, one entry per field (F of them).

    Build with :meth:`build`, which validates; the constructor only checks shapes.

    Attributes:
        mode: int32 [F], :data:`MODE_MODULO` or :data:`MODE_HASH`.
        cardinality: int64 [F], rows per field, > 0.
        row_offset: int64 [F], first row of each field in the packed table.
    """

    mode: Tensor
    cardinality: Tensor
    row_offset: Tensor

    def __post_init__(self) -> None:
        f = self.mode.numel()
        for name, t, dtype in (("mode", self.mode, torch.int32), ("cardinality", self.cardinality, torch.int64),
                               ("row_offset", self.row_offset, torch.int64)):  # fmt: skip
            if t.dim() != 1 or t.numel() != f or t.dtype != dtype:
                raise ValueError(
                    f"FieldIdParams.{name} must be {dtype} [F={f}], got {t.dtype} {tuple(t.shape)}"
                )
        if f == 0:
            raise ValueError("FieldIdParams needs at least one field")

    @classmethod
    def build(
        cls,
        cardinalities: Sequence[int],
        modes: str | Sequence[str] = "modulo",
        row_offsets: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        device: torch.device | str | None = None,
    ) -> FieldIdParams:
        """Validated parameters from Python values.

        Args:
            cardinalities: Rows per field (F values, each > 0).
            modes: ``"modulo"`` or ``"hash"``, for all fields or per field.
            row_offsets: First packed row per field; default packs the fields back to
                back (exclusive cumulative sum of ``cardinalities``).
            names: Field names, for error messages.
            device: Where the parameter tensors live (that of the ids).

        Raises:
            ConfigError: naming the field and the bad value.
        """
        cards = [int(c) for c in cardinalities]
        f = len(cards)
        if f == 0:
            raise ConfigError("FieldIdParams needs at least one field")
        names = list(names) if names is not None else [f"#{i}" for i in range(f)]
        modes = _per_field(modes, f, "modes")
        if row_offsets is None:
            row_offsets = [sum(cards[:i]) for i in range(f)]
        offs = [int(o) for o in _per_field(row_offsets, f, "row_offsets")]
        for name, mode, card, off in zip(names, modes, cards, offs):
            if mode not in ID_MODES:
                raise ConfigError(f"field {name}: id mode {mode!r} is not one of {ID_MODES}")
            if card <= 0:
                raise ConfigError(f"field {name}: cardinality {card} must be > 0")
            if off < 0 or off + card - 1 > _INT64_MAX:
                raise ConfigError(f"field {name}: rows {off}..{off + card - 1} do not fit int64 row indices")
        return cls(
            mode=torch.tensor([ID_MODES.index(m) for m in modes], dtype=torch.int32, device=device),
            cardinality=torch.tensor(cards, dtype=torch.int64, device=device),
            row_offset=torch.tensor(offs, dtype=torch.int64, device=device),
        )

    @property
    def num_fields(self) -> int:
        return self.mode.numel()

    @property
    def device(self) -> torch.device:
        return self.mode.device

    def to(self, device: torch.device | str) -> FieldIdParams:
        return FieldIdParams(self.mode.to(device), self.cardinality.to(device), self.row_offset.to(device))


@dataclass(frozen=True)
class DenseTransformParams:
    """Per-column dense-transform parameters, one entry per column (Dd of them).

    Attributes:
        op: int32 [Dd], :data:`OP_IDENTITY`, :data:`OP_LOG1P` or :data:`OP_CLIP`.
        clip_min: float32 [Dd], lower bound (``-inf`` for none).
        clip_max: float32 [Dd], upper bound (``+inf`` for none).
    """

    op: Tensor
    clip_min: Tensor
    clip_max: Tensor

    def __post_init__(self) -> None:
        n = self.op.numel()
        for name, t, dtype in (("op", self.op, torch.int32), ("clip_min", self.clip_min, torch.float32),
                               ("clip_max", self.clip_max, torch.float32)):  # fmt: skip
            if t.dim() != 1 or t.numel() != n or t.dtype != dtype:
                raise ValueError(
                    f"DenseTransformParams.{name} must be {dtype} [Dd={n}], got {t.dtype} {tuple(t.shape)}"
                )

    @classmethod
    def build(
        cls,
        ops: str | Sequence[str],
        num_columns: int | None = None,
        clip_min: float | Sequence[float] = float("-inf"),
        clip_max: float | Sequence[float] = float("inf"),
        names: Sequence[str] | None = None,
        device: torch.device | str | None = None,
    ) -> DenseTransformParams:
        """Validated parameters from Python values.

        Args:
            ops: One of :data:`DENSE_OPS` for all columns, or one per column.
            num_columns: Dd; needed when ``ops`` is a single name.
            clip_min: Lower bound, for all columns or per column.
            clip_max: Upper bound, for all columns or per column.
            names: Column names, for error messages.
            device: Where the parameter tensors live (that of the data).

        Raises:
            ConfigError: naming the column and the bad value.
        """
        if isinstance(ops, str):
            if num_columns is None:
                raise ConfigError("DenseTransformParams.build: give num_columns when ops is a single name")
            ops = [ops] * num_columns
        ops = list(ops)
        n = len(ops)
        if num_columns is not None and num_columns != n:
            raise ConfigError(f"ops has {n} entries but num_columns is {num_columns}")
        names = list(names) if names is not None else [f"#{i}" for i in range(n)]
        los = [float(v) for v in _per_field(clip_min, n, "clip_min")]
        his = [float(v) for v in _per_field(clip_max, n, "clip_max")]
        for name, op, lo, hi in zip(names, ops, los, his):
            if op not in DENSE_OPS:
                raise ConfigError(f"dense column {name}: op {op!r} is not one of {DENSE_OPS}")
            if math.isnan(lo) or math.isnan(hi) or lo > hi:
                raise ConfigError(f"dense column {name}: clip range [{lo}, {hi}] is empty or NaN")
        return cls(
            op=torch.tensor([DENSE_OPS.index(o) for o in ops], dtype=torch.int32, device=device),
            clip_min=torch.tensor(los, dtype=torch.float32, device=device),
            clip_max=torch.tensor(his, dtype=torch.float32, device=device),
        )

    @property
    def num_columns(self) -> int:
        return self.op.numel()

    def to(self, device: torch.device | str) -> DenseTransformParams:
        return DenseTransformParams(self.op.to(device), self.clip_min.to(device), self.clip_max.to(device))


def check_map_ids_inputs(values: Tensor, offsets: Tensor, params: FieldIdParams) -> int:
    """Validates shapes and devices; returns the batch size B."""
    if values.dim() != 1 or values.dtype != torch.int64:
        raise ValueError(f"map_ids: values must be int64 [N], got {values.dtype} {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.dtype != torch.int64 or offsets.numel() < 1:
        raise ValueError(
            f"map_ids: offsets must be int64 [F*B+1], got {offsets.dtype} {tuple(offsets.shape)}"
        )
    f = params.num_fields
    if (offsets.numel() - 1) % f != 0:
        raise ValueError(f"map_ids: offsets has {offsets.numel()} entries, not F*B+1 for F={f} fields")
    if not (values.device == offsets.device == params.device):
        raise ValueError(
            f"map_ids: values ({values.device}), offsets ({offsets.device}) and params ({params.device}) "
            "must be on one device"
        )
    if offsets.device.type == "cpu":  # free on CPU; on GPU it would cost a sync
        first, last = int(offsets[0]), int(offsets[-1])
        if first != 0 or last != values.numel():
            raise ValueError(f"map_ids: offsets must run from 0 to N={values.numel()}, got {first}..{last}")
    return (offsets.numel() - 1) // f


def check_dense_inputs(x: Tensor, params: DenseTransformParams) -> None:
    """Validates shapes, dtype and device of a :func:`~recaccel.ops.field_ops.dense_transform` call."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"dense_transform: x must be floating [B, Dd], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != params.num_columns:
        raise ValueError(f"dense_transform: x has {x.shape[1]} columns, params have {params.num_columns}")
    if x.device != params.op.device:
        raise ValueError(
            f"dense_transform: x ({x.device}) and params ({params.op.device}) must be on one device"
        )
