"""The Triton fused update's sorted occurrences, made with the batch's preparation.

A training preparation of a fused Triton pack holds its occurrences in sorted order (the
sort's keys, bags and scales gathered by its order, and the pieces of the piece-lane
backward when that is the device's tuned kernel), made right after the sort on the
preparing stream; the update then launches its kernels on them without gathering again,
the stream bookkeeping covers them, and a training step with either backward matches the
reference backend. Runs under TRITON_INTERPRET=1 (conftest.py) or on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.triton import backward, tuning
from recaccel.ops.embedding.triton.occurrences import usable
from recaccel.ops.embedding.triton.piece_lanes import LaneConfig
from recaccel.ops.embedding.triton.pieces import build_pieces
from tests.helpers.marks import needs_triton

pytestmark = needs_triton

CFG = SparseOptimConfig(lr=0.1, eps=1e-3, weight_decay=0.01)
LANES = {"piece_len": 3, "block_pieces": 4, "unroll": 2, "num_warps": 2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(optimizer: str) -> list[TableSpec]:
    return [
        TableSpec("a", 3, 8, pooling="mean", optimizer=optimizer),
        TableSpec("b", 40, 8, features=["b1", "b2"], optimizer=optimizer),
        TableSpec("c", 2, 8, optimizer=optimizer),
    ]


def _batch(sparse_batch, seed: int = 0):
    rows = {"a": 3, "b1": 40, "b2": 40, "c": 2}
    gen = torch.Generator().manual_seed(seed)
    return sparse_batch(
        rows, ["b2", "c", "a", "b1"], 6, max_len=5, weighted=True, generator=gen, device=DEVICE
    )


def _tuned_lanes(monkeypatch) -> None:
    """Every backward key of this device tuned to the piece lanes (``LANES``)."""
    real = tuning.lookup

    def lookup(device, key, table=None):
        return dict(LANES) if key.startswith("bwd_") else real(device, key, table)

    monkeypatch.setattr(tuning, "lookup", lookup)


def _step(m: PackedEmbeddingBag, sf, seed: int) -> torch.Tensor:
    out = m.forward_concat(sf)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out * g).sum().backward()
    return out.detach()


@pytest.mark.parametrize("lanes", [False, True], ids=["tiles", "lanes"])
def test_a_fused_training_preparation_holds_the_sorted_occurrences(lanes, sparse_batch, monkeypatch):
    if lanes:
        _tuned_lanes(monkeypatch)
    m = PackedEmbeddingBag(_tables("rowwise_adagrad"), backend="triton", optim=CFG, seed=1, device=DEVICE)
    prepared = m.prepare(_batch(sparse_batch))
    packs = [p for p in prepared.packs if p is not None]
    assert packs
    for pack in packs:
        occ, groups = pack.sorted, pack.groups
        assert torch.equal(occ.keys, groups.sorted_rows)
        assert torch.equal(occ.bags, pack.ids.bags[groups.order])
        assert torch.equal(occ.scale, pack.ids.scale[groups.order])
        if lanes:
            want = build_pieces(occ.keys, LANES["piece_len"])
            assert occ.piece_len == LANES["piece_len"]
            assert torch.equal(occ.piece_start, want.start) and torch.equal(occ.num_pieces, want.count)
        else:
            assert occ.piece_len is None and occ.piece_start is None
        held = {id(t) for t in prepared.tensors()}
        assert all(id(t) in held for t in occ.tensors())  # marked used by the consuming stream


def test_the_update_reads_the_preparation_instead_of_gathering_again(sparse_batch, monkeypatch):
    _tuned_lanes(monkeypatch)
    m = PackedEmbeddingBag(_tables("adam"), backend="triton", optim=CFG, seed=1, device=DEVICE)
    want = PackedEmbeddingBag(_tables("adam"), backend="reference", optim=CFG, seed=1, device=DEVICE)
    sf = _batch(sparse_batch, seed=2)
    prepared = m.prepare(sf)

    def gather_again(*args, **kwargs):
        raise AssertionError("the update gathered the occurrences again")

    monkeypatch.setattr(backward, "sort_occurrences", gather_again)
    torch.testing.assert_close(_step(m, prepared, 3), _step(want, sf, 3))
    for k, v in want.state_dict().items():
        torch.testing.assert_close(m.state_dict()[k], v, msg=lambda msg, k=k: f"{k}: {msg}")


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("lanes", [False, True], ids=["tiles", "lanes"])
def test_fused_steps_with_either_backward_match_the_reference(lanes, optimizer, sparse_batch, monkeypatch):
    if lanes:
        _tuned_lanes(monkeypatch)
    got = PackedEmbeddingBag(_tables(optimizer), backend="triton", optim=CFG, seed=4, device=DEVICE)
    want = PackedEmbeddingBag(_tables(optimizer), backend="reference", optim=CFG, seed=4, device=DEVICE)
    for step in range(2):
        sf = _batch(sparse_batch, seed=10 + step)
        torch.testing.assert_close(_step(got, sf, 20 + step), _step(want, sf, 20 + step))
        for k, v in want.state_dict().items():
            torch.testing.assert_close(got.state_dict()[k], v, msg=lambda msg, k=k: f"{k}: {msg}")


def test_occurrences_made_for_other_pieces_are_made_again():
    keys = torch.tensor([0, 0, 1])
    from recaccel.ops.embedding.prepared import SortedOccurrences

    plain = SortedOccurrences(keys, keys)
    cut = SortedOccurrences(keys, keys, None, 2, *build_pieces(keys, 2))
    assert usable(plain, backward.TileConfig(8, 4)) and not usable(plain, LaneConfig(2, 4, 1, 2))
    assert usable(cut, LaneConfig(2, 8, 2, 4)) and not usable(cut, LaneConfig(4, 4, 1, 2))
    assert not usable(cut, backward.TileConfig(8, 4)) and not usable(None, backward.TileConfig(8, 4))


def test_density_buckets_are_occurrences_per_row_rounded_up_to_a_power_of_two():
    from recaccel.ops.embedding.triton.backward_config import density_bucket

    assert density_bucket(1_703_936, 13_100_000) == 1  # criteo one-hot: most rows alone
    assert density_bucket(26 * 16384 * 20, 26 * 20000) == 32  # L=20 into 20k-row tables
    assert density_bucket(3, 1) == 4 and density_bucket(0, 5) == 1 and density_bucket(10**9, 1) == 32


def test_a_bucketed_entry_wins_over_the_unbucketed_one_and_prepare_and_update_agree(
    sparse_batch, monkeypatch
):
    """The table holds tiles for every density and lanes for this batch's bucket only: the
    preparation cuts pieces for the lanes and the update reads them, no second gather."""
    from recaccel.ops.embedding.triton.backward_config import density_bucket

    m = PackedEmbeddingBag(_tables("rowwise_adagrad"), backend="triton", optim=CFG, seed=1, device=DEVICE)
    sf = _batch(sparse_batch, seed=5)
    prepared = m.prepare(sf)
    pack = next(p for p in prepared.packs if p is not None)
    layout = next(p.layout for p in m._packs)
    bucket = density_bucket(pack.ids.rows.numel(), layout.num_rows)
    table = {"cpu": {tuning.backward_key(8, torch.float32): {"block_occ": 8, "num_warps": 4},
                     tuning.backward_key(8, torch.float32, bucket): dict(LANES)}}  # fmt: skip
    monkeypatch.setattr(tuning, "_load_table", lambda: table)
    monkeypatch.setattr(tuning, "device_name", lambda device: "cpu")
    assert backward.tile_config(8, torch.float32, DEVICE, bucket) == LaneConfig(**LANES)
    assert backward.tile_config(8, torch.float32, DEVICE, bucket * 2) == backward.TileConfig(8, 4)
    assert backward.tile_config(8, torch.float32, DEVICE) == backward.TileConfig(8, 4)
    prepared = m.prepare(sf)
    assert all(p.sorted.piece_len == LANES["piece_len"] for p in prepared.packs if p is not None)

    def gather_again(*args, **kwargs):
        raise AssertionError("the update gathered the occurrences again")

    monkeypatch.setattr(backward, "sort_occurrences", gather_again)
    _step(m, prepared, 6)


def test_the_backward_kernel_a_step_runs_is_logged_once_per_shape(sparse_batch, monkeypatch, caplog):
    from recaccel.ops.embedding.triton.backward_config import log_choice

    log_choice.cache_clear()
    _tuned_lanes(monkeypatch)
    m = PackedEmbeddingBag(_tables("rowwise_adagrad"), backend="triton", optim=CFG, seed=1, device=DEVICE)
    with caplog.at_level("INFO", logger="recaccel.ops.embedding.triton.backward_config"):
        for seed in (1, 2):
            _step(m, _batch(sparse_batch, seed=seed), seed)
    lines = [r.getMessage() for r in caplog.records if "embedding backward" in r.getMessage()]
    assert len(lines) == 1 and "piece lanes" in lines[0] and "D=8 float32" in lines[0], lines


@pytest.mark.parametrize("one_sort", [True, False], ids=["one-sort", "pack-by-pack"])
def test_each_queued_grouping_gets_its_then_once_after_the_sort(one_sort, monkeypatch):
    from recaccel.ops.embedding.row_groups import PackSort, group_by_row

    monkeypatch.setattr(PackSort, "one_sort", staticmethod(lambda device: one_sort))
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, n, (k,), generator=gen) for n, k in ((5, 9), (40, 30), (3, 1))]
    sort, seen = PackSort(), []
    groups = [
        sort.group(r, n, False, then=lambda g, p=p: seen.append((p, g)))
        for p, (r, n) in enumerate(zip(rows, (5, 40, 3)))
    ]
    assert seen == []  # nothing before the sort runs
    sort.run()
    assert [p for p, _ in seen] == [0, 1, 2] and all(g is groups[p] for p, g in seen)
    for r, n, g in zip(rows, (5, 40, 3), groups):
        assert torch.equal(g.sorted_rows, group_by_row(r, n, unique=False).sorted_rows)
    sort.run()  # nothing queued: no second call
    assert len(seen) == 3


def test_a_then_that_raises_leaves_every_grouping_sorted():
    from recaccel.ops.embedding.row_groups import PackSort

    def boom(groups):
        raise RuntimeError("boom")

    sort = PackSort()
    first = sort.group(torch.tensor([2, 0, 1]), 3, False, then=boom)
    second = sort.group(torch.tensor([1, 1, 0]), 2, False)
    with pytest.raises(RuntimeError, match="boom"):
        sort.run()
    assert first.order is not None and second.order is not None
    assert second.sorted_rows.tolist() == [0, 1, 1]
