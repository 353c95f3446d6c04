"""Columns: rows of a dataset as host numpy arrays, the reader's working form.

A :class:`Columns` holds n rows: dense features, labels, one CSR bag per sparse field
and optional int64 side columns (task key, timestamp). Row selection (``take``),
contiguous slices and concatenation are vectorized, CSR bags included, so shuffling a
buffer never loops over rows in Python. ``to_batch`` turns the rows into a
:class:`~recaccel.io.batch.Batch` (field-major CSR, the KeyedJaggedTensor layout).

Shapes: n rows, Dd dense features, F sparse fields, N_f ids of field f.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from recaccel.io.batch import Batch, SparseFeatures


@dataclass
class Columns:
    """n rows in columnar numpy form.

    Attributes:
        dense: float32 [n, Dd].
        labels: float32 [n].
        keys: F sparse field names.
        values: F arrays, int64 [N_f], the ids of field f for all rows.
        offsets: F arrays, int64 [n+1], starting at 0: row i of field f holds
            ``values[f][offsets[f][i]:offsets[f][i+1]]``.
        extra: side columns by name (task key, timestamp), int64 [n] each.
        single: F flags, True where every bag of the field holds exactly one id (then
            ``offsets`` is ``arange(n+1)`` and gathers skip the CSR work); None =
            computed from the offsets.
    """

    dense: np.ndarray
    labels: np.ndarray
    keys: list[str]
    values: list[np.ndarray]
    offsets: list[np.ndarray]
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    single: list[bool] | None = None

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if self.dense.ndim != 2 or self.dense.shape[0] != n:
            raise ValueError(f"dense has shape {self.dense.shape}, expected [{n}, Dd]")
        if not (len(self.keys) == len(self.values) == len(self.offsets)):
            raise ValueError("keys, values and offsets must have one entry per sparse field")
        for key, off in zip(self.keys, self.offsets):
            if off.shape != (n + 1,):
                raise ValueError(f"offsets of field {key!r} have shape {off.shape}, expected ({n + 1},)")
        for name, col in self.extra.items():
            if col.shape != (n,):
                raise ValueError(f"side column {name!r} has shape {col.shape}, expected ({n},)")
        if self.single is None:
            self.single = [_all_single(off) for off in self.offsets]
        elif len(self.single) != len(self.keys):
            raise ValueError("single must have one flag per sparse field")

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def __len__(self) -> int:
        return self.num_rows

    def take(self, idx: np.ndarray) -> Columns:
        """Rows ``idx`` (int [m], any order, repeats allowed) as new arrays."""
        idx = np.asarray(idx, dtype=np.int64)
        values, offsets = [], []
        for val, off, single in zip(self.values, self.offsets, self.single):
            v, o = (
                (val[idx], np.arange(idx.shape[0] + 1, dtype=np.int64)) if single else take_csr(val, off, idx)
            )
            values.append(v)
            offsets.append(o)
        return Columns(
            dense=self.dense[idx],
            labels=self.labels[idx],
            keys=list(self.keys),
            values=values,
            offsets=offsets,
            extra={k: v[idx] for k, v in self.extra.items()},
            single=list(self.single),
        )

    def slice(self, start: int, stop: int) -> Columns:
        """Rows ``start .. stop-1`` as views where possible (no per-row work)."""
        start, stop = max(0, start), min(self.num_rows, stop)
        stop = max(start, stop)
        values = [val[off[start] : off[stop]] for val, off in zip(self.values, self.offsets)]
        offsets = [off[start : stop + 1] - off[start] for off in self.offsets]
        return Columns(
            dense=self.dense[start:stop],
            labels=self.labels[start:stop],
            keys=list(self.keys),
            values=values,
            offsets=offsets,
            extra={k: v[start:stop] for k, v in self.extra.items()},
            single=list(self.single),
        )

    @staticmethod
    def concat(parts: list[Columns]) -> Columns:
        """Rows of ``parts`` one after another; all parts must have the same columns.

        Raises:
            ValueError: on an empty list or parts with different columns.
        """
        if not parts:
            raise ValueError("Columns.concat needs at least one part")
        first = parts[0]
        if len(parts) == 1:
            return first
        for p in parts[1:]:
            if (
                p.keys != first.keys
                or p.extra.keys() != first.extra.keys()
                or p.dense.shape[1] != first.dense.shape[1]
            ):
                raise ValueError("Columns.concat: parts have different columns")
        n = sum(p.num_rows for p in parts)
        single = [all(p.single[f] for p in parts) for f in range(len(first.keys))]
        values, offsets = [], []
        for f in range(len(first.keys)):
            values.append(np.concatenate([p.values[f] for p in parts]))
            offsets.append(
                np.arange(n + 1, dtype=np.int64)
                if single[f]
                else _concat_offsets([p.offsets[f] for p in parts])
            )
        return Columns(
            dense=np.concatenate([p.dense for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            keys=list(first.keys),
            values=values,
            offsets=offsets,
            extra={k: np.concatenate([p.extra[k] for p in parts]) for k in first.extra},
            single=single,
        )

    @classmethod
    def empty(cls, keys: list[str], num_dense: int, extra: tuple[str, ...] = ()) -> Columns:
        """Zero rows with the given columns."""
        return cls(
            dense=np.zeros((0, num_dense), dtype=np.float32),
            labels=np.zeros(0, dtype=np.float32),
            keys=list(keys),
            values=[np.zeros(0, dtype=np.int64) for _ in keys],
            offsets=[np.zeros(1, dtype=np.int64) for _ in keys],
            extra={k: np.zeros(0, dtype=np.int64) for k in extra},
        )

    def to_batch(self) -> Batch:
        """A CPU :class:`Batch` owning fresh memory (it never aliases this object).

        The sparse part is field-major: bag ``(f, b)`` is
        ``values[offsets[f*B+b] : offsets[f*B+b+1]]`` with offsets int64 [F*B+1].
        """
        n = self.num_rows
        if self.keys:
            values = np.concatenate(self.values)
            bases = np.cumsum([0] + [v.shape[0] for v in self.values[:-1]])
            offsets = np.empty(len(self.keys) * n + 1, dtype=np.int64)
            offsets[0] = 0
            for f, (off, base) in enumerate(zip(self.offsets, bases)):
                offsets[f * n + 1 : (f + 1) * n + 1] = off[1:] + base
        else:
            values = np.zeros(0, dtype=np.int64)
            offsets = np.zeros(1, dtype=np.int64)
        sparse = SparseFeatures(
            list(self.keys),
            torch.from_numpy(np.array(values, dtype=np.int64, copy=True)),
            torch.from_numpy(offsets),
        )
        return Batch(
            dense=torch.from_numpy(np.array(self.dense, dtype=np.float32, order="C", copy=True)),
            sparse=sparse,
            labels=torch.from_numpy(np.array(self.labels, dtype=np.float32, copy=True)),
        )


def take_csr(values: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gathers CSR rows without a Python loop.

    Args:
        values: int64 [N] ids.
        offsets: int64 [n+1], starting at 0.
        idx: int64 [m] rows to gather.

    Returns:
        (values int64 [M], offsets int64 [m+1]) of the gathered rows.
    """
    lengths = (offsets[1:] - offsets[:-1])[idx]
    new_off = np.zeros(idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_off[1:])
    total = int(new_off[-1])
    if total == 0:
        return np.zeros(0, dtype=values.dtype), new_off
    # Source position of output element j: start of its bag + its rank inside the bag.
    shift = offsets[:-1][idx] - new_off[:-1]
    src = np.arange(total, dtype=np.int64) + np.repeat(shift, lengths)
    return values[src], new_off


def _all_single(offsets: np.ndarray) -> bool:
    n = offsets.shape[0] - 1
    return bool(offsets[-1] == n and np.array_equal(offsets, np.arange(n + 1)))


def _concat_offsets(parts: list[np.ndarray]) -> np.ndarray:
    """Joins per-part offsets (each starting at 0) into offsets of the concatenation."""
    out = [parts[0]]
    base = parts[0][-1]
    for off in parts[1:]:
        out.append(off[1:] + base)
        base = base + off[-1]
    return np.concatenate(out).astype(np.int64, copy=False)
