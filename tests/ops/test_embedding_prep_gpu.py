"""The training preparation's kernels compiled on CUDA at real sizes, against their references.

The interpreter tests (``test_embedding_pack_ids.py``, ``test_embedding_backward_lanes.py``)
hold them to the references on small inputs; compiled code can differ from the
interpreter (scans, atomics, int8 stores, scalar loops), so here the same equalities at
the sizes of the GPU benchmarks: T=26 B=16,384 L=20 (8.5 M ids) and a one-hot B=65,536
batch; pieces of 8.5 M sorted uniform and Zipf keys. Integers: equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.ops.embedding.packing import LocalFeatures, gather_pack_ids
from recaccel.ops.embedding.preparation import as_kernel_input
from recaccel.sparse import SparseFeatures

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

T, ROWS = 26, 100_000


def _local(check: bool) -> LocalFeatures:
    sizes = [ROWS - 997 * f for f in range(T)]
    shifts = [sum(sizes[:f]) for f in range(T)]
    mean = [f % 4 == 0 for f in range(T)]
    return LocalFeatures.build(
        list(range(T)), shifts, mean, T, torch.device("cuda"), sizes if check else None
    )


def _ids(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ids mostly in range, 1% outside (negative or past the smallest table)."""
    ids = torch.randint(0, ROWS - 997 * (T - 1), (n,), generator=gen, device="cuda")
    wild = torch.rand(n, generator=gen, device="cuda") < 0.01
    return torch.where(wild, torch.where(ids % 2 == 0, -1 - ids, ids + ROWS), ids)


def _assert_same(sf: SparseFeatures, local: LocalFeatures, batch_size: int) -> None:
    from recaccel.ops.embedding.triton.pack_ids import fused_pack_ids

    want = gather_pack_ids(sf, local, batch_size, with_bags=True)
    got = fused_pack_ids(sf, local, batch_size, with_bags=True)
    for name in ("rows", "offsets", "scale", "bags", "bad"):
        w, g = getattr(want, name), getattr(got, name)
        assert (w is None) == (g is None), name
        if w is not None:
            assert g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_gpu_pack_ids_of_a_multi_hot_batch_equal_the_reference(index):
    gen = torch.Generator(device="cuda").manual_seed(1)
    b = 16_384
    lengths = torch.randint(0, 41, (T * b,), generator=gen, device="cuda")  # mean 20, empty bags too
    ids = _ids(int(lengths.sum()), gen)
    weights = torch.rand(ids.numel(), generator=gen, device="cuda") + 0.5
    sf = SparseFeatures.from_lengths([f"f{f}" for f in range(T)], ids, lengths, weights)
    sf = SparseFeatures(sf.keys, sf.values.to(index), sf.offsets.to(index), sf.weights)
    _assert_same(sf, _local(check=True), b)


def test_gpu_pack_ids_of_a_one_hot_batch_equal_the_reference():
    gen = torch.Generator(device="cuda").manual_seed(2)
    b = 65_536
    sf = as_kernel_input(SparseFeatures([f"f{f}" for f in range(T)], _ids(T * b, gen).int(), None))
    _assert_same(sf, _local(check=True), b)
    _assert_same(sf, _local(check=False), b)


@pytest.mark.parametrize("skew", ["uniform", "zipf"])
@pytest.mark.parametrize("piece_len", [32, 128])
def test_gpu_pieces_of_8_million_keys_equal_the_reference(skew, piece_len):
    from recaccel.ops.embedding.triton.pieces import build_pieces, reference_pieces

    gen = torch.Generator(device="cuda").manual_seed(3)
    n, rows = 8_519_680, 520_000
    if skew == "uniform":
        keys = torch.randint(0, rows, (n,), generator=gen, device="cuda")
    else:  # rank r drawn with weight (r+1)^-1.05: a few rows of hundreds of thousands
        weights = torch.arange(1, rows + 1, device="cuda", dtype=torch.float64) ** -1.05
        keys = torch.multinomial(weights, n, replacement=True, generator=gen)
    keys = torch.sort(keys.int()).values
    got, want = build_pieces(keys, piece_len), reference_pieces(keys, piece_len)
    assert torch.equal(got.count, want.count) and torch.equal(got.start, want.start)
