"""SparseFeatures.select: fields of a field-major CSR batch, against per-bag Python lists."""

from __future__ import annotations

import pytest
import torch

from recaccel.errors import DataError
from recaccel.sparse import SparseFeatures


def random_features(b: int, keys: list[str], seed: int, weighted: bool) -> SparseFeatures:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * b,), generator=g)  # empty bags included
    n = int(lengths.sum())
    values = torch.randint(0, 1000, (n,), generator=g)
    weights = torch.rand(n, generator=g) if weighted else None
    return SparseFeatures.from_lengths(keys, values, lengths, weights)


def bags(sf: SparseFeatures) -> dict[str, list]:
    b, off = sf.batch_size, sf.offsets.tolist()
    out = {}
    for f, key in enumerate(sf.keys):
        rows = []
        for i in range(b):
            lo, hi = off[f * b + i], off[f * b + i + 1]
            w = None if sf.weights is None else sf.weights[lo:hi].tolist()
            rows.append((sf.values[lo:hi].tolist(), w))
        out[key] = rows
    return out


@pytest.mark.parametrize("b", [0, 1, 5])
@pytest.mark.parametrize("weighted", [False, True])
def test_selected_fields_keep_their_bags_in_the_asked_order(b, weighted):
    keys = ["a", "b", "c", "d"]
    sf = random_features(b, keys, seed=b, weighted=weighted)
    want = bags(sf)
    for names in (["c", "a"], ["d"], keys, ["b", "c", "d", "a"]):
        got = sf.select(names)
        assert got.keys == names and got.batch_size == b
        assert bags(got) == {n: want[n] for n in names}
    with pytest.raises(DataError, match="no sparse field 'z'"):
        sf.select(["a", "z"])


@pytest.mark.parametrize("b", [0, 3])
def test_reorder_puts_every_field_in_the_asked_order_without_copying_a_match(b):
    keys = ["a", "b", "c", "d"]
    sf = random_features(b, keys, seed=7 + b, weighted=True)
    assert sf.reorder(keys) is sf and sf.select(keys) is sf  # the common case costs nothing
    order = ["d", "b", "a", "c"]
    got = sf.reorder(order)
    assert got.keys == order and got.offsets.dtype == torch.int64
    assert bags(got) == {n: bags(sf)[n] for n in order}
    # int32 offsets (as TorchRec allows) give the same bags and int64 offsets.
    narrow = SparseFeatures(keys, sf.values, sf.offsets.int(), sf.weights)
    assert bags(narrow.reorder(order)) == bags(got) and narrow.reorder(order).offsets.dtype == torch.int64


def test_reorder_names_missing_unknown_and_repeated_fields_in_one_line():
    sf = random_features(2, ["a", "b", "c"], seed=1, weighted=False)
    cases = {
        ("a", "b", "c", "d"): "missing 'd'",
        ("a", "b"): "unknown 'c'",
        ("a", "x", "y"): "missing 'x', 'y', unknown 'b', 'c'",
    }
    for names, message in cases.items():
        with pytest.raises(DataError, match=message) as e:
            sf.reorder(list(names))
        assert "\n" not in str(e.value)
    twice = random_features(2, ["a", "b", "a"], seed=1, weighted=False)
    with pytest.raises(DataError, match="repeated 'a'"):
        twice.reorder(["b", "a"])
    with pytest.raises(DataError, match="asked for more than once"):
        sf.select(["a", "a"])
