"""Row-wise concatenation of two SparseFeatures and the support/query split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recaccel.errors import DataError
from recaccel.meta.rows import concat_rows, split_task_rows
from recaccel.sparse import SparseFeatures


def _bags(sf: SparseFeatures) -> list[list[tuple[list[int], list[float] | None]]]:
    """bags[f][b] = (ids, weights) read straight from the CSR."""
    out = []
    for f in range(sf.num_fields):
        field = []
        for b in range(sf.batch_size):
            lo, hi = int(sf.offsets[f * sf.batch_size + b]), int(sf.offsets[f * sf.batch_size + b + 1])
            w = None if sf.weights is None else sf.weights[lo:hi].tolist()
            field.append((sf.values[lo:hi].tolist(), w))
        out.append(field)
    return out


@st.composite
def sparse_batches(draw, keys, weighted):
    rows = draw(st.integers(0, 4))
    lengths = draw(st.lists(st.integers(0, 3), min_size=len(keys) * rows, max_size=len(keys) * rows))
    n = sum(lengths)
    values = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
    weights = torch.arange(n, dtype=torch.float32) + 0.5 if weighted else None
    return SparseFeatures.from_lengths(
        keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64), weights
    )


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_fields=st.integers(1, 3), wa=st.booleans(), wb=st.booleans())
def test_concat_rows_matches_bag_by_bag(data, num_fields, wa, wb):
    keys = [f"k{i}" for i in range(num_fields)]
    a = data.draw(sparse_batches(keys, wa))
    b = data.draw(sparse_batches(keys, wb))
    out = concat_rows(a, b)
    assert out.keys == keys and out.batch_size == a.batch_size + b.batch_size
    assert int(out.offsets[0]) == 0 and int(out.offsets[-1]) == out.values.numel()
    bags_a, bags_b, bags = _bags(a), _bags(b), _bags(out)
    for f in range(num_fields):
        want = bags_a[f] + bags_b[f]
        assert [ids for ids, _ in bags[f]] == [ids for ids, _ in want]
        if not (wa or wb):
            assert out.weights is None
        else:
            ones = lambda bag: [1.0] * len(bag[0]) if bag[1] is None else bag[1]
            assert [w for _, w in bags[f]] == [ones(bag) for bag in want]


def test_concat_rows_rejects_different_fields():
    a = SparseFeatures.from_lengths(["x"], torch.tensor([1]), torch.tensor([1]))
    b = SparseFeatures.from_lengths(["y"], torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(DataError, match="missing 'x', unknown 'y'"):
        concat_rows(a, b)


def test_concat_rows_matches_fields_by_name():
    a = SparseFeatures.from_lengths(["x", "y"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
    b = SparseFeatures.from_lengths(["y", "x"], torch.tensor([7, 8, 9]), torch.tensor([1, 2]))
    out = concat_rows(a, b)
    assert out.keys == ["x", "y"]
    assert out.field("x")[0].tolist() == [1, 8, 9] and out.field("y")[0].tolist() == [2, 3, 7]


def test_split_task_rows_is_task_major():
    t, s, q = 3, 2, 4
    rows = torch.arange(t * (s + q)).float().unsqueeze(1)
    sup, qry = split_task_rows(rows, t, s, q)
    assert sup.shape == (t, s, 1) and qry.shape == (t, q, 1)
    assert sup[1, 0, 0] == 1 * s and qry[2, 3, 0] == t * s + 2 * q + 3
    with pytest.raises(ValueError, match="rows"):
        split_task_rows(rows[:-1], t, s, q)
