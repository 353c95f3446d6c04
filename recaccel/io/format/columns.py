"""Columns: rows of a dataset as host numpy arrays, the reader's working form.

A :class:`Columns` holds n rows: dense features, labels, one CSR bag per sparse field
and optional int64 side columns (task key, timestamp). Row selection (``take``),
contiguous slices and concatenation are vectorized, CSR bags included, so shuffling a
buffer never loops over rows in Python. ``to_batch`` turns the rows into a
:class:`~recaccel.sparse.Batch` (field-major CSR, the KeyedJaggedTensor layout).

Shapes: n rows, Dd dense features, F sparse fields, N_f ids of field f.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from recaccel.io.format.schema import INT32_IDS
from recaccel.sparse import Batch, SparseFeatures


@dataclass
class Columns:
    """n rows in columnar numpy form.

    Attributes:
        dense: float32 [n, Dd].
        labels: float32 [n].
        keys: F sparse field names.
        values: F integer arrays [N_f], the ids of field f for all rows (int32 or int64
            as decoded; batches get :attr:`id_dtype`).
        offsets: F arrays, int64 [n+1], starting at 0: row i of field f holds
            ``values[f][offsets[f][i]:offsets[f][i+1]]``.
        side: side columns by name (task key, timestamp), int64 [n] each.
        single: F flags, True where every bag of the field holds exactly one id (then
            ``offsets`` is ``arange(n+1)`` and gathers skip the CSR work); None =
            computed from the offsets.
        ids: None, or int [n, Fs] row-major ids of the Fs single-hot fields whose
            ``values`` are its columns (views), in field order. One row's ids then
            share cache lines, which makes a random row gather (``take_batch``) several
            times faster than gathering Fs separate arrays.
        id_dtype: the dtype of the ids in batches made from these rows (int32 when every
            table fits, see :func:`id_dtype`); ``values`` may be wider (the decoder's
            zero-copy int64 views), and are narrowed by the copy into the batch. None =
            :func:`batch_id_dtype` of ``values``.
    """

    dense: np.ndarray
    labels: np.ndarray
    keys: list[str]
    values: list[np.ndarray]
    offsets: list[np.ndarray]
    side: dict[str, np.ndarray] = field(default_factory=dict)
    single: list[bool] | None = None
    ids: np.ndarray | None = None
    id_dtype: np.dtype | None = None

    def __post_init__(self) -> None:
        self.id_dtype = batch_id_dtype(self.values) if self.id_dtype is None else np.dtype(self.id_dtype)
        n = self.labels.shape[0]
        if self.dense.ndim != 2 or self.dense.shape[0] != n:
            raise ValueError(f"dense has shape {self.dense.shape}, expected [{n}, Dd]")
        if not (len(self.keys) == len(self.values) == len(self.offsets)):
            raise ValueError("keys, values and offsets must have one entry per sparse field")
        for key, off in zip(self.keys, self.offsets):
            if off.shape != (n + 1,):
                raise ValueError(f"offsets of field {key!r} have shape {off.shape}, expected ({n + 1},)")
        for name, col in self.side.items():
            if col.shape != (n,):
                raise ValueError(f"side column {name!r} has shape {col.shape}, expected ({n},)")
        if self.single is None:
            self.single = [_all_single(off) for off in self.offsets]
        elif len(self.single) != len(self.keys):
            raise ValueError("single must have one flag per sparse field")
        if self.ids is not None and self.ids.shape != (n, sum(self.single)):
            raise ValueError(f"ids has shape {self.ids.shape}, expected ({n}, {sum(self.single)})")

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def __len__(self) -> int:
        return self.num_rows

    def take(self, idx: np.ndarray) -> Columns:
        """Rows ``idx`` (int [m], any order, repeats allowed) as new arrays (row-major
        ids stay row-major)."""
        idx = np.asarray(idx, dtype=np.int64)
        steps = single_hot_offsets(idx.shape[0])  # shared by every single-hot field
        # Row-major ids stay row-major: one gather of whole rows, fields as views.
        ids = None if self.ids is None else np.take(self.ids, idx, axis=0)
        values, offsets = [], []
        col = 0  # column of the next single-hot field in ``ids``
        for val, off, single in zip(self.values, self.offsets, self.single):
            if not single:
                v, o = take_csr(val, off, idx)
            elif ids is not None:
                v, o = ids[:, col], steps
                col += 1
            else:
                v, o = np.take(val, idx), steps
            values.append(v)
            offsets.append(o)
        return Columns(
            dense=np.take(self.dense, idx, axis=0),
            labels=np.take(self.labels, idx),
            keys=list(self.keys),
            values=values,
            offsets=offsets,
            side={k: np.take(v, idx) for k, v in self.side.items()},
            single=list(self.single),
            ids=ids,
            id_dtype=self.id_dtype,
        )

    def slice(self, start: int, stop: int) -> Columns:
        """Rows ``start .. stop-1`` as views where possible (no per-row work)."""
        start, stop = max(0, start), min(self.num_rows, stop)
        stop = max(start, stop)
        values = [val[off[start] : off[stop]] for val, off in zip(self.values, self.offsets)]
        steps = single_hot_offsets(stop - start)
        offsets = [
            steps if single else off[start : stop + 1] - off[start]
            for off, single in zip(self.offsets, self.single)
        ]
        return Columns(
            dense=self.dense[start:stop],
            labels=self.labels[start:stop],
            keys=list(self.keys),
            values=values,
            offsets=offsets,
            side={k: v[start:stop] for k, v in self.side.items()},
            single=list(self.single),
            ids=None if self.ids is None else self.ids[start:stop],
            id_dtype=self.id_dtype,
        )

    @staticmethod
    def concat(parts: list[Columns], row_major_ids: bool = False) -> Columns:
        """Rows of ``parts`` one after another; all parts must have the same columns.

        With ``row_major_ids`` the single-hot ids are stored as one row-major ``ids``
        matrix (worth it for a buffer whose rows are gathered at random).

        Raises:
            ValueError: on an empty list or parts with different columns.
        """
        if not parts:
            raise ValueError("Columns.concat needs at least one part")
        first = parts[0]
        if len(parts) == 1 and not (row_major_ids and first.ids is None and any(first.single)):
            return first
        for p in parts[1:]:
            if (
                p.keys != first.keys
                or p.side.keys() != first.side.keys()
                or p.dense.shape[1] != first.dense.shape[1]
            ):
                raise ValueError("Columns.concat: parts have different columns")
        n = sum(p.num_rows for p in parts)
        dtype = np.result_type(*(p.id_dtype for p in parts))
        single = [all(p.single[f] for p in parts) for f in range(len(first.keys))]
        steps = single_hot_offsets(n)
        ids = None
        if row_major_ids and any(single):
            stacked = all(p.ids is not None and p.single == single for p in parts)
            # Parts already row-major join with one contiguous copy.
            stacked = stacked and all(p.ids.dtype == dtype for p in parts)
            ids = np.concatenate([p.ids for p in parts]) if stacked else _stack_ids(parts, single, n, dtype)
        values, offsets = [], []
        k = 0
        for f in range(len(first.keys)):
            if ids is not None and single[f]:
                values.append(ids[:, k])
                k += 1
            else:
                values.append(np.concatenate([p.values[f] for p in parts]))
            offsets.append(steps if single[f] else _concat_offsets([p.offsets[f] for p in parts]))
        return Columns(
            dense=np.concatenate([p.dense for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            keys=list(first.keys),
            values=values,
            offsets=offsets,
            side={k: np.concatenate([p.side[k] for p in parts]) for k in first.side},
            single=single,
            ids=ids,
            id_dtype=dtype,
        )

    @classmethod
    def empty(cls, keys: list[str], num_dense: int, side: tuple[str, ...] = ()) -> Columns:
        """Zero rows with the given columns."""
        return cls(
            dense=np.zeros((0, num_dense), dtype=np.float32),
            labels=np.zeros(0, dtype=np.float32),
            keys=list(keys),
            values=[np.zeros(0, dtype=np.int32) for _ in keys],  # joins any id dtype unchanged
            offsets=[np.zeros(1, dtype=np.int64) for _ in keys],
            side={k: np.zeros(0, dtype=np.int64) for k in side},
        )

    def to_batch(self) -> Batch:
        """A CPU :class:`Batch` owning fresh memory (it never aliases this object).

        The sparse part is field-major: bag ``(f, b)`` is
        ``values[offsets[f*B+b] : offsets[f*B+b+1]]`` (see :func:`take_batch` for the
        dtypes and the one-hot case).
        """
        return take_batch(self, slice(0, self.num_rows))


def take_batch(cols: Columns, rows: np.ndarray | slice) -> Batch:
    """Rows of ``cols`` as a CPU Batch, gathered once into the batch's own arrays.

    Same result as ``cols.take(rows).to_batch()`` without the intermediate copy; the
    batch never aliases ``cols``. The sparse part is field-major CSR: values int32 when
    every field's ids are int32, else int64 (one dtype per batch); offsets int64
    [F*B+1], or none at all (implicit, see :class:`SparseFeatures`) when every field
    is single-hot, which saves their copy to the device.

    Args:
        cols: the rows.
        rows: int64 [B] row indices (any order, repeats allowed), or a contiguous
            ``slice(start, stop)`` (step 1) of rows.
    """
    ids = None
    if isinstance(rows, slice):
        start, stop, step = rows.indices(cols.num_rows)
        if step != 1:
            raise ValueError(f"take_batch needs a slice with step 1, got {rows}")
        stop = max(start, stop)
        b = stop - start
        dense = np.array(cols.dense[start:stop], dtype=np.float32, order="C", copy=True)
        labels = np.array(cols.labels[start:stop], dtype=np.float32, copy=True)
        bags = [
            (None if cols.ids is not None else v[start:stop], None)
            if single
            else (v[o[start] : o[stop]], o[start : stop + 1] - o[start])
            for v, o, single in zip(cols.values, cols.offsets, cols.single)
        ]
        # Row-major ids: the rows are a view, copied field-major in transposed blocks.
        ids = None if cols.ids is None else cols.ids[start:stop]
    else:
        idx = np.asarray(rows, dtype=np.int64)
        b = idx.shape[0]
        dense = np.take(cols.dense, idx, axis=0)
        labels = np.take(cols.labels, idx)
        bags = [
            (None, None) if single else take_csr(v, o, idx)
            for v, o, single in zip(cols.values, cols.offsets, cols.single)
        ]
        # One gather of whole rows, then per-field copies from cache.
        ids = None if cols.ids is None else np.take(cols.ids, idx, axis=0)
    sizes = [b if off is None else bag.shape[0] for bag, off in bags]
    values = np.empty(sum(sizes), dtype=cols.id_dtype)  # narrows wider decoded ids
    one_hot = bool(bags) and all(cols.single)
    offsets = None if one_hot else np.empty(len(bags) * b + 1, dtype=np.int64)
    if offsets is not None:
        offsets[0] = 0
    base = 0
    k = 0  # column of the next single-hot field in ``ids``
    f = 0
    while f < len(bags):
        bag, off = bags[f]
        # A run of r consecutive fields whose ids come from the gathered rows is one
        # transposed block copy; any other field is one bag.
        r = 1
        if bag is None and ids is not None:
            while f + r < len(bags) and bags[f + r][0] is None:
                r += 1
        dst = values[base : base + r * b] if bag is None else values[base : base + sizes[f]]
        if bag is not None:
            dst[...] = bag
        elif ids is not None:
            np.copyto(dst.reshape(r, b), ids[:, k : k + r].T)
        elif cols.values[f].dtype == dst.dtype:  # a single-hot field gathered straight into the batch
            np.take(cols.values[f], idx, out=dst)
        else:  # ids of another width than the batch's
            dst[...] = np.take(cols.values[f], idx)
        if offsets is not None:
            ends = np.arange(1, r * b + 1, dtype=np.int64) if off is None else off[1:]
            np.add(ends, base, out=offsets[f * b + 1 : (f + r) * b + 1])
        k += sum(cols.single[f : f + r])
        base += dst.shape[0]
        f += r
    sparse = SparseFeatures(
        list(cols.keys), torch.from_numpy(values), None if offsets is None else torch.from_numpy(offsets)
    )
    return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels))


def take_csr(values: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gathers CSR rows without a Python loop.

    Args:
        values: int [N] ids.
        offsets: int64 [n+1], starting at 0.
        idx: int64 [m] rows to gather.

    Returns:
        (values [M] in the ids' dtype, offsets int64 [m+1]) of the gathered rows.
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


def _stack_ids(parts: list[Columns], single: list[bool], n: int, dtype: np.dtype) -> np.ndarray:
    """``dtype`` [n, Fs]: the single-hot ids of ``parts`` one after another, row-major."""
    fields = [f for f, s in enumerate(single) if s]
    ids = np.empty((n, len(fields)), dtype=dtype)
    row = 0
    for p in parts:
        block = ids[row : row + p.num_rows]
        for k, f in enumerate(fields):
            block[:, k] = p.values[f]
        row += p.num_rows
    return ids


def id_dtype(cardinality: int) -> np.dtype:
    """The id dtype of a table of ``cardinality`` rows: int32 when every id fits, else int64."""
    return np.dtype(np.int32) if cardinality <= INT32_IDS else np.dtype(np.int64)


def batch_id_dtype(values: list[np.ndarray]) -> np.dtype:
    """One id dtype for arrays of ids: int64 if any of them is wider than int32."""
    return np.dtype(np.int32) if values and all(v.dtype == np.int32 for v in values) else np.dtype(np.int64)


def single_hot_offsets(n: int) -> np.ndarray:
    """Read-only ``arange(n+1)``: the offsets of a single-hot field, shared between fields."""
    steps = np.arange(n + 1, dtype=np.int64)
    steps.flags.writeable = False
    return steps


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
