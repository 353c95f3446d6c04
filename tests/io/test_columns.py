"""Columns: gathers into batches (index arrays, slices, row-major ids) against Python rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recaccel.io.format.columns import Columns, take_batch

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXACT = dict(rtol=0, atol=0)


def random_columns(rng, n: int, dd: int, multi: list[bool]) -> Columns:
    values, offsets = [], []
    for m in multi:
        lengths = rng.integers(0, 4, n) if m else np.ones(n, dtype=np.int64)
        offsets.append(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        values.append(rng.integers(0, 1000, int(lengths.sum())))
    return Columns(
        rng.normal(size=(n, dd)).astype(np.float32),
        rng.random(n).astype(np.float32),
        [f"f{i}" for i in range(len(multi))],
        values,
        offsets,
    )


def python_rows(cols: Columns) -> list[tuple]:
    """(label, dense, bags) per row, read one element at a time."""
    return [
        (
            float(cols.labels[i]),
            tuple(float(x) for x in cols.dense[i]),
            tuple(tuple(int(x) for x in v[o[i] : o[i + 1]]) for v, o in zip(cols.values, cols.offsets)),
        )
        for i in range(cols.num_rows)
    ]


def check_batch(batch, rows: list[tuple], keys: list[str], dd: int) -> None:
    b, nf = len(rows), len(keys)
    bags = [rows[i][2][f] for f in range(nf) for i in range(b)]
    offsets = torch.zeros(nf * b + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(x) for x in bags], dtype=torch.int64), 0)
    values = torch.tensor([v for bag in bags for v in bag], dtype=torch.int64)
    assert batch.sparse.keys == keys
    torch.testing.assert_close(batch.sparse.offsets, offsets, **EXACT)
    torch.testing.assert_close(batch.sparse.values, values, **EXACT)
    dense = torch.tensor([r[1] for r in rows], dtype=torch.float32).reshape(b, dd)
    torch.testing.assert_close(batch.dense, dense, **EXACT)
    torch.testing.assert_close(batch.labels, torch.tensor([r[0] for r in rows], dtype=torch.float32), **EXACT)


@SETTINGS
@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=4),
    st.integers(0, 3),
    st.lists(st.booleans(), max_size=5),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_gathers_match_python_rows(part_rows, dd, multi, row_major, seed):
    rng = np.random.default_rng(seed)
    parts = [random_columns(rng, n, dd, multi) for n in part_rows]
    cols = Columns.concat(parts, row_major_ids=row_major)
    rows = [r for p in parts for r in python_rows(p)]
    n, keys = len(rows), [f"f{i}" for i in range(len(multi))]
    assert python_rows(cols) == rows
    if row_major and not all(multi):
        assert cols.ids is not None and cols.ids.flags.c_contiguous
    idx = rng.integers(0, n, int(rng.integers(0, 30))) if n else np.zeros(0, dtype=np.int64)
    check_batch(take_batch(cols, idx), [rows[i] for i in idx], keys, dd)
    taken = cols.take(idx)
    check_batch(taken.to_batch(), [rows[i] for i in idx], keys, dd)
    assert (taken.ids is not None) == (cols.ids is not None)  # row-major stays row-major
    joined = Columns.concat([taken, cols], row_major_ids=True)  # stacked parts: one copy
    assert python_rows(joined) == [rows[i] for i in idx] + rows
    a, b = sorted(int(x) for x in rng.integers(0, n + 1, 2))
    check_batch(take_batch(cols, slice(a, b)), rows[a:b], keys, dd)
    sliced = cols.slice(a, b)
    assert python_rows(sliced) == rows[a:b]
    check_batch(sliced.to_batch(), rows[a:b], keys, dd)


def test_batch_never_aliases_the_columns():
    rng = np.random.default_rng(0)
    cols = Columns.concat([random_columns(rng, 9, 2, [False, True, False])] * 2, row_major_ids=True)
    before = python_rows(cols)
    for batch in (take_batch(cols, np.arange(5)), take_batch(cols, slice(0, 18)), cols.to_batch()):
        batch.dense.fill_(-1)
        batch.labels.fill_(-1)
        batch.sparse.values.fill_(-1)
    assert python_rows(cols) == before


def test_single_hot_offsets_are_read_only_and_checked():
    rng = np.random.default_rng(1)
    cols = Columns.concat([random_columns(rng, 4, 1, [False, False])] * 2)
    with pytest.raises(ValueError):
        cols.offsets[0][0] = 5  # shared between fields: must not be writable
    with pytest.raises(ValueError, match="step 1"):
        take_batch(cols, slice(0, 4, 2))
    with pytest.raises(ValueError, match="ids has shape"):
        Columns(cols.dense, cols.labels, cols.keys, cols.values, cols.offsets, ids=np.zeros((8, 1), np.int64))
