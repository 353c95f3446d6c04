"""The batch types' row operations against a plain per-row reference.

Every CSR here is read back bag by bag (``bags[f][b] = (ids, weights)``) and compared
with the same operation done on Python lists: slicing rows or tasks, stacking the rows
of two batches, picking fields, and splitting a support-then-query output back into
tasks. Inputs are random with the edge cases drawn on purpose: empty bags, a batch of
one row or none, one field, per-id weights present or absent.
"""

from __future__ import annotations

import doctest

import pytest
import torch

import recaccel.sparse.batches
import recaccel.sparse.features
from recaccel.errors import DataError
from recaccel.sparse import Batch, SparseFeatures, TaskBatch

Bags = list[list[tuple[list[int], list[float] | None]]]


def bags_of(sf: SparseFeatures) -> Bags:
    """bags[f][b] = (ids, weights or None), read straight from the CSR."""
    b = sf.batch_size
    out = []
    for f in range(sf.num_fields):
        field = []
        for row in range(b):
            lo, hi = int(sf.offsets[f * b + row]), int(sf.offsets[f * b + row + 1])
            w = None if sf.weights is None else sf.weights[lo:hi].tolist()
            field.append((sf.values[lo:hi].tolist(), w))
        out.append(field)
    return out


def check_csr(sf: SparseFeatures) -> None:
    """The invariants every result must keep: int64 offsets from 0 to N, F*B+1 of them."""
    assert sf.offsets.dtype == torch.int64 and int(sf.offsets[0]) == 0
    assert int(sf.offsets[-1]) == sf.values.numel()
    assert bool((sf.offsets.diff() >= 0).all())
    assert sf.offsets.numel() == sf.num_fields * sf.batch_size + 1


def random_sparse(
    gen: torch.Generator, keys: list[str], rows: int, weighted: bool, empty_share: float = 0.3
) -> SparseFeatures:
    """``rows`` rows of ``keys``; about ``empty_share`` of the bags are empty."""
    lengths = torch.randint(1, 4, (len(keys) * rows,), generator=gen)
    lengths[torch.rand(lengths.shape, generator=gen) < empty_share] = 0
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape, generator=gen) + 0.5 if weighted else None
    return SparseFeatures.from_lengths(keys, values, lengths, weights)


# (fields, rows): one field, a batch of one, no rows, and ordinary shapes.
SHAPES = [(1, 1), (1, 5), (3, 1), (3, 0), (2, 7), (4, 4)]


def _cases():
    for seed, (fields, rows) in enumerate(SHAPES):
        for weighted in (False, True):
            yield pytest.param(seed, fields, rows, weighted, id=f"F{fields}-B{rows}-w{int(weighted)}")


@pytest.mark.parametrize("seed,fields,rows,weighted", list(_cases()))
def test_slice_rows_matches_per_row_reference(seed, fields, rows, weighted):
    gen = torch.Generator().manual_seed(seed)
    sf = random_sparse(gen, [f"k{i}" for i in range(fields)], rows, weighted)
    ref = bags_of(sf)
    for lo in range(rows + 1):
        for hi in range(lo, rows + 1):
            part = sf.slice_rows(lo, hi)
            check_csr(part)
            assert part.keys == sf.keys and part.batch_size == hi - lo
            assert bags_of(part) == [field[lo:hi] for field in ref]
            assert (part.weights is None) == (not weighted)


def test_slice_rows_all_empty_bags():
    sf = SparseFeatures.from_lengths(
        ["a", "b"], torch.zeros(0, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    )
    part = sf.slice_rows(1, 3)
    check_csr(part)
    assert part.values.numel() == 0 and part.batch_size == 2


@pytest.mark.parametrize("lo,hi", [(-1, 2), (2, 1), (0, 4), (4, 4)])
def test_slicing_outside_the_batch_is_refused(lo, hi):
    gen = torch.Generator().manual_seed(0)
    batch = Batch(torch.zeros(3, 2), random_sparse(gen, ["a", "b"], 3, False), torch.zeros(3))
    with pytest.raises(ValueError, match=r"rows \[.*\) are not within the batch's 3 rows"):
        batch.sparse.slice_rows(lo, hi)
    with pytest.raises(ValueError, match="not within"):
        batch.slice_rows(lo, hi)


@pytest.mark.parametrize("seed,fields,rows,weighted", list(_cases()))
def test_concat_rows_matches_per_row_reference(seed, fields, rows, weighted):
    gen = torch.Generator().manual_seed(100 + seed)
    keys = [f"k{i}" for i in range(fields)]
    for other_rows in (0, 1, 3):
        for other_weighted in (False, True):
            a = random_sparse(gen, keys, rows, weighted)
            b = random_sparse(gen, keys, other_rows, other_weighted)
            out = a.concat_rows(b)
            check_csr(out)
            assert out.keys == keys and out.batch_size == rows + other_rows
            if not (weighted or other_weighted):
                assert out.weights is None
                assert bags_of(out) == [fa + fb for fa, fb in zip(bags_of(a), bags_of(b))]
                continue

            def ones(field):  # a batch without weights joins with weight 1 per id
                return [(ids, [1.0] * len(ids) if w is None else w) for ids, w in field]

            assert bags_of(out) == [ones(fa) + ones(fb) for fa, fb in zip(bags_of(a), bags_of(b))]


def test_concat_rows_matches_fields_by_name():
    a = SparseFeatures.from_lengths(["x", "y"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
    b = SparseFeatures.from_lengths(["y", "x"], torch.tensor([7, 8, 9]), torch.tensor([1, 2]))
    out = a.concat_rows(b)
    assert out.keys == ["x", "y"]
    assert out.field("x")[0].tolist() == [1, 8, 9] and out.field("y")[0].tolist() == [2, 3, 7]


def test_concat_rows_refuses_other_fields():
    a = SparseFeatures.from_lengths(["x"], torch.tensor([1]), torch.tensor([1]))
    b = SparseFeatures.from_lengths(["y"], torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(DataError, match="missing 'x', unknown 'y'"):
        a.concat_rows(b)


@pytest.mark.parametrize("seed", range(4))
def test_select_matches_per_field_reference(seed):
    gen = torch.Generator().manual_seed(200 + seed)
    keys = ["a", "b", "c", "d"]
    sf = random_sparse(gen, keys, [1, 3, 0, 5][seed], weighted=seed % 2 == 1)
    ref = dict(zip(keys, bags_of(sf)))
    for names in (["d", "a", "c", "b"], ["c"], ["b", "d"], ["d", "c", "b", "a"]):
        out = sf.select(names)
        check_csr(out)
        assert out.keys == names and bags_of(out) == [ref[n] for n in names]
    assert sf.reorder(["b", "a", "d", "c"]).keys == ["b", "a", "d", "c"]


def random_task_batch(gen: torch.Generator, tasks: int, s: int, q: int, weighted: bool) -> TaskBatch:
    keys = ["u", "i", "c"]

    def rows(n: int) -> Batch:
        return Batch(
            torch.randn(n, 2, generator=gen),
            random_sparse(gen, keys, n, weighted),
            torch.rand(n, generator=gen),
            torch.rand(n, generator=gen) if weighted else None,
        )

    return TaskBatch(
        rows(tasks * s),
        rows(tasks * q),
        (torch.rand(tasks, s, generator=gen) > 0.3).float(),
        (torch.rand(tasks, q, generator=gen) > 0.3).float(),
        torch.arange(tasks) * 10 + 7,
    )


def _batch_rows(batch: Batch) -> list[tuple]:
    """Each row of a Batch as plain values: dense, bags of every field, label, weight."""
    bags = bags_of(batch.sparse)
    return [
        (
            batch.dense[r].tolist(),
            [field[r] for field in bags],
            float(batch.labels[r]),
            None if batch.weights is None else float(batch.weights[r]),
        )
        for r in range(batch.batch_size)
    ]


@pytest.mark.parametrize("tasks,s,q,weighted", [(1, 1, 1, False), (4, 2, 3, True), (3, 1, 4, False)])
def test_slice_tasks_matches_per_task_reference(tasks, s, q, weighted):
    tb = random_task_batch(torch.Generator().manual_seed(tasks), tasks, s, q, weighted)
    support, query = _batch_rows(tb.support), _batch_rows(tb.query)
    for lo in range(tasks + 1):
        for hi in range(lo, tasks + 1):
            part = tb.slice_tasks(lo, hi)
            assert part.num_tasks == hi - lo and part.task_ids.tolist() == tb.task_ids[lo:hi].tolist()
            assert (part.support_size, part.query_size) == (s, q)
            assert _batch_rows(part.support) == support[lo * s : hi * s]
            assert _batch_rows(part.query) == query[lo * q : hi * q]
            assert part.support_mask.tolist() == tb.support_mask[lo:hi].tolist()
            assert part.query_mask.tolist() == tb.query_mask[lo:hi].tolist()
    with pytest.raises(
        ValueError, match=f"tasks \\[0, {tasks + 1}\\) are not within the batch's {tasks} tasks"
    ):
        tb.slice_tasks(0, tasks + 1)


def test_concat_sparse_and_split_rows_are_support_then_query_by_task():
    tasks, s, q = 3, 2, 4
    tb = random_task_batch(torch.Generator().manual_seed(5), tasks, s, q, weighted=False)
    joined = tb.concat_sparse()
    check_csr(joined)
    assert bags_of(joined) == [
        fs + fq for fs, fq in zip(bags_of(tb.support.sparse), bags_of(tb.query.sparse))
    ]

    rows = torch.arange(tasks * (s + q)).float().unsqueeze(1)  # row r's output is r
    sup, qry = tb.split_rows(rows)
    assert sup.shape == (tasks, s, 1) and qry.shape == (tasks, q, 1)
    for t in range(tasks):
        assert sup[t, :, 0].tolist() == [t * s + i for i in range(s)]
        assert qry[t, :, 0].tolist() == [tasks * s + t * q + i for i in range(q)]
    with pytest.raises(ValueError, match=r"expected 6 \+ 12 rows for T=3, S=2, Q=4, got 17"):
        tb.split_rows(rows[:-1])


def test_examples_in_the_docstrings_hold():
    results = [
        doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        for module in (recaccel.sparse.features, recaccel.sparse.batches)
    ]
    assert sum(r.attempted for r in results) >= 5 and sum(r.failed for r in results) == 0
