"""The Triton one-pass pack ids (``fused_pack_ids``) against the reference ``gather_pack_ids``.

Rows, offsets, bags and the bad-id count are integers: equal bit for bit; scales are one
float32 product (the weight, times ``1/L`` under mean pooling), correctly rounded in both:
equal too. Fresh random batches: empty bags, bags of one, a 300-id bag among short ones,
duplicate ids, out-of-range ids (negative and past the table), one feature, a batch of
one, int32 and int64 ids and offsets, one-hot batches, weights, mean pooling, shifted
tables. The kernel runs under TRITON_INTERPRET=1 without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding.packing import LocalFeatures, gather_pack_ids
from recaccel.sparse import SparseFeatures

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fused():
    from recaccel.ops.embedding.triton.pack_ids import fused_pack_ids

    return fused_pack_ids


def _local(sizes: list[int], mean: list[bool], *, check: bool) -> LocalFeatures:
    """A pack of ``len(sizes)`` features, each its own table, the tables laid end to end."""
    shifts = [sum(sizes[:f]) for f in range(len(sizes))]
    return LocalFeatures.build(
        list(range(len(sizes))), shifts, mean, len(sizes), torch.device(DEVICE), sizes if check else None
    )


def _batch(
    sizes: list[int],
    batch_size: int,
    gen: torch.Generator,
    *,
    max_len: int,
    weighted: bool,
    bad: float = 0.0,
    long_bag: int = 0,
    index: torch.dtype = torch.int64,
) -> SparseFeatures:
    """Random bags of 0..max_len ids (bag 0 of feature 0 holding ``long_bag`` ids when
    given); a share ``bad`` of the ids outside their table, half negative, half past it."""
    lengths = torch.randint(0, max_len + 1, (len(sizes) * batch_size,), generator=gen)
    if long_bag:
        lengths[0] = long_bag
    values = []
    for f, rows in enumerate(sizes):
        n = int(lengths[f * batch_size : (f + 1) * batch_size].sum())
        ids = torch.randint(0, rows, (n,), generator=gen)
        out = torch.rand(n, generator=gen) < bad
        wild = torch.where(torch.rand(n, generator=gen) < 0.5, -1 - ids, rows + ids)
        values.append(torch.where(out, wild, ids))
    ids = torch.cat(values)
    weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    sf = SparseFeatures.from_lengths([f"f{i}" for i in range(len(sizes))], ids, lengths, weights)
    return SparseFeatures(sf.keys, sf.values.to(index), sf.offsets.to(index), sf.weights).to(DEVICE)


def _assert_same(
    sf: SparseFeatures, local: LocalFeatures, batch_size: int, *, with_bags: bool = True
) -> None:
    want = gather_pack_ids(sf, local, batch_size, with_bags=with_bags)
    got = _fused()(sf, local, batch_size, with_bags=with_bags)
    for name in ("rows", "offsets", "scale", "bags", "bad"):
        w, g = getattr(want, name), getattr(got, name)
        assert (w is None) == (g is None), name
        if w is not None:
            assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
            assert torch.equal(g, w), name


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_multi_hot_batches_give_the_references_ids_bit_for_bit(seed, weighted, check):
    gen = torch.Generator().manual_seed(seed)
    sizes = [
        int(torch.randint(1, 50, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 6, (1,), generator=gen)))
    ]
    mean = [bool(torch.rand(1, generator=gen) < 0.5) for _ in sizes]
    batch_size = int(torch.randint(1, 40, (1,), generator=gen))
    sf = _batch(sizes, batch_size, gen, max_len=4, weighted=weighted, bad=0.1 if check else 0.0)
    _assert_same(sf, _local(sizes, mean, check=check), batch_size)


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_index_dtypes_and_a_300_id_bag_among_short_ones(index):
    gen = torch.Generator().manual_seed(7)
    sizes = [30, 5, 11]
    sf = _batch(sizes, 33, gen, max_len=2, weighted=True, bad=0.05, long_bag=300, index=index)
    _assert_same(sf, _local(sizes, [True, False, True], check=True), 33)
    # int64 ids with int32 offsets: the index dtype is int64 (both must be int32 to narrow)
    mixed = SparseFeatures(sf.keys, sf.values.long(), sf.offsets.int(), sf.weights)
    _assert_same(mixed, _local(sizes, [False, True, False], check=True), 33, with_bags=False)


def test_one_feature_a_batch_of_one_and_only_empty_bags():
    gen = torch.Generator().manual_seed(3)
    _assert_same(_batch([9], 1, gen, max_len=5, weighted=False), _local([9], [True], check=True), 1)
    empty = SparseFeatures(["f0", "f1"], torch.zeros(0, dtype=torch.int64, device=DEVICE),
                           torch.zeros(9, dtype=torch.int64, device=DEVICE))  # fmt: skip
    _assert_same(empty, _local([4, 4], [True, False], check=True), 4)


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_one_hot_batches_skip_the_search_and_match(index):
    gen = torch.Generator().manual_seed(11)
    sizes, batch_size = [17, 3, 40, 8], 25
    ids = torch.cat([torch.randint(-2, rows + 2, (batch_size,), generator=gen) for rows in sizes]).to(index)
    sf = SparseFeatures([f"f{i}" for i in range(len(sizes))], ids.to(DEVICE), None)
    assert sf.one_hot
    from recaccel.ops.embedding.preparation import as_kernel_input

    _assert_same(as_kernel_input(sf), _local(sizes, [False, True, False, True], check=True), batch_size)


def test_zipf_ids_over_a_thousand_features():
    """Many features (a 14-step search over 3,000 bags) and hot rows."""
    gen = torch.Generator().manual_seed(5)
    sizes = [2 + f % 7 for f in range(1000)]
    sf = _batch(sizes, 3, gen, max_len=3, weighted=True, bad=0.02)
    _assert_same(sf, _local(sizes, [f % 3 == 0 for f in range(1000)], check=True), 3)


def test_a_pack_that_is_not_the_batch_as_is_is_refused():
    local = LocalFeatures.build([1, 0], [0, 4], [False, False], 2, torch.device(DEVICE))
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="a pack taking the batch's CSR as is"):
        _fused()(_batch([4, 4], 2, gen, max_len=2, weighted=False), local, 2, with_bags=True)
