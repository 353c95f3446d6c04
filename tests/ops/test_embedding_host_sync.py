"""Embedding input preparation without host synchronization.

On CUDA ``torch.cuda.set_sync_debug_mode("error")`` would catch a sync; on the CPU
:func:`~tests.helpers.host_reads.host_reads` records every operation that would read a
device value on the host while the prepare + lookup + update path runs: a host read that
creeps back into that path fails here.

The Triton kernels run under TRITON_INTERPRET=1 without CUDA (tiny shapes).
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.io.host_buffer import pack, unpack
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.row_groups import PackSort, group_by_row, group_packs
from recaccel.sparse import Batch, SparseFeatures
from tests.helpers.host_reads import host_reads

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)

TABLES = [
    TableSpec("a", 11, 4, pooling="mean"),
    TableSpec("b", 7, 4, features=["b1", "b2"]),
    TableSpec("s", 5, 4, optimizer="sgd"),
]
ONE_PACK = ["b2", "a", "b1"]  # every feature in pack 0, not in the pack's order
TWO_PACKS = ["b2", "s", "a", "b1"]


def _module(
    backend: str, optimizer: str = "adam", mode: str = "fused", device: str = "cpu"
) -> PackedEmbeddingBag:
    tables = [dataclasses.replace(t, optimizer=optimizer) for t in TABLES[:2]]
    return PackedEmbeddingBag(
        [*tables, TABLES[2]],
        backend=backend,
        mode=mode,
        optim=SparseOptimConfig(lr=0.1),
        bounds_check="deferred",
        device=device,
    )


def _batch(sparse_batch, keys: list[str], seed: int, index=torch.int64) -> SparseFeatures:
    rows = {f: t.num_rows for t in TABLES for f in t.features}
    gen = torch.Generator().manual_seed(seed)
    sf = sparse_batch(rows, keys, 5, weighted=True, generator=gen)
    return SparseFeatures(sf.keys, sf.values.to(index), sf.offsets.to(index), sf.weights)


def _step(m: PackedEmbeddingBag, sf: SparseFeatures) -> None:
    """What a pipelined step runs: prepare, lookup, and (training) the fused update."""
    out = m(m.prepare(sf))
    if m.training:
        out.backward(torch.ones_like(out))


def _reads_of_a_step(m: PackedEmbeddingBag, sf: SparseFeatures) -> list[str]:
    _step(m, sf)  # the first step compiles and caches the routing
    with host_reads() as seen:
        _step(m, sf)
    m.check_ids()
    return seen


def test_host_reads_records_each_kind_of_read():
    t = torch.tensor([3, 1, 3])
    with host_reads() as seen:
        t.sum().item(), int(t[0]), bool(t.any()), torch.unique_consecutive(t), t.nonzero()
    assert [s.split(" at ")[0] for s in seen] == [
        "item",
        "__int__",
        "__bool__",
        "unique_consecutive",
        "nonzero",
    ]


def test_host_reads_records_output_sizes_read_from_the_device():
    """bincount and repeat_interleave by tensor repeats size their output from device values
    on CUDA; repeats by an int or with output_size do not."""
    t = torch.tensor([2, 0, 1])
    with host_reads() as seen:
        t.bincount(), torch.repeat_interleave(t), t.repeat_interleave(t)
        t.repeat_interleave(2), torch.repeat_interleave(t, t, output_size=3)
    assert [s.split(" at ")[0] for s in seen] == ["bincount", "repeat_interleave", "repeat_interleave"]


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_a_triton_training_step_never_reads_the_device(optimizer, index, sparse_batch):
    m = _module("triton", optimizer).train()
    assert _reads_of_a_step(m, _batch(sparse_batch, ONE_PACK, seed=1, index=index)) == []


@needs_triton
def test_a_triton_evaluation_lookup_never_reads_the_device_even_with_two_packs(sparse_batch):
    m = _module("triton").eval()
    assert _reads_of_a_step(m, _batch(sparse_batch, TWO_PACKS, seed=2)) == []


@pytest.mark.parametrize("mode", ["fused", "autograd"])
def test_a_reference_lookup_never_reads_the_device(mode, sparse_batch):
    m = _module("reference", mode=mode).eval()
    assert _reads_of_a_step(m, _batch(sparse_batch, ONE_PACK, seed=3)) == []


def test_a_reference_autograd_training_step_never_reads_the_device(sparse_batch):
    m = _module("reference", mode="autograd").train()
    assert _reads_of_a_step(m, _batch(sparse_batch, ONE_PACK, seed=4)) == []


@needs_triton
def test_a_batch_split_among_packs_is_read_once_for_all_packs(sparse_batch):
    """A batch made on the device (its field counts unknown to the host): one read."""
    m = _module("triton").train()
    seen = _reads_of_a_step(m, _batch(sparse_batch, TWO_PACKS, seed=5))
    assert len(seen) == 1 and seen[0].startswith("tolist at packing.py"), seen


def _through_the_loader(sf: SparseFeatures) -> SparseFeatures:
    """``sf`` as the device loader hands it over: unpacked from its one buffer, with the
    field counts counted on the host before the copy."""
    b = sf.batch_size
    batch = Batch(torch.zeros(b, 1), sf, torch.zeros(b))
    return unpack(*pack(batch)).sparse


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_a_batch_split_among_packs_from_the_loader_is_never_read(backend, index, sparse_batch):
    m = _module(backend).train()
    sf = _through_the_loader(_batch(sparse_batch, TWO_PACKS, seed=9, index=index))
    assert sf.known_field_counts is not None
    seen = _reads_of_a_step(m, sf)
    if backend == "reference":  # its fused update (a specification) reads the unique rows
        seen = [s for s in seen if "packing.py" in s]
    assert seen == []


@needs_triton
def test_a_one_hot_batch_split_among_packs_is_never_read():
    m = _module("triton").train()
    rows = {f: t.num_rows for t in TABLES for f in t.features}
    gen = torch.Generator().manual_seed(10)
    ids = torch.cat([torch.randint(0, rows[k], (6,), generator=gen) for k in TWO_PACKS])
    assert _reads_of_a_step(m, SparseFeatures(TWO_PACKS, ids.int(), None)) == []


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_counts_from_the_host_give_the_step_the_device_read_gives(backend, sparse_batch):
    """Same lookups, same updated rows and optimizer state, bit for bit."""
    read, known = _module(backend).train(), _module(backend).train()
    known.load_state_dict(read.state_dict())
    for seed in (11, 12):
        sf = _batch(sparse_batch, TWO_PACKS, seed=seed)
        carried = _through_the_loader(sf)
        assert sf.known_field_counts is None and carried.known_field_counts is not None
        got, want = known(known.prepare(carried)), read(read.prepare(sf))
        assert torch.equal(got, want)
        got.backward(torch.ones_like(got))
        want.backward(torch.ones_like(want))
    for name, state in read.table_states().items():
        for key, tensor in state.items():
            assert torch.equal(known.table_state(name)[key], tensor), (name, key)


# ------------------------------------------------------------ one sort for all packs


def _pack_rows(seed: int, sizes: list[int], num_rows: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Few distinct rows per pack: long runs of equal keys, where a stable sort's order shows.
    return [torch.randint(0, min(r, 9), (n,), generator=gen).to(dtype) for n, r in zip(sizes, num_rows)]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_rows", [[40, 9, 300], [2**31 - 10, 9, 2**20]])  # int32 keys, int64 keys
def test_one_sort_for_all_packs_is_bitwise_the_per_pack_sorts(dtype, num_rows):
    rows = _pack_rows(7, [200, 0, 57], num_rows, dtype)
    together = group_packs(rows, num_rows, [True, False, True])
    for r, n, got in zip(rows, num_rows, together):
        want = group_by_row(r, n)
        assert torch.equal(got.order, want.order)
        assert got.sorted_rows.dtype == want.sorted_rows.dtype
        assert torch.equal(got.sorted_rows, want.sorted_rows)
        assert torch.equal(got.unique_rows, want.unique_rows)
        assert torch.equal(got.segments, want.segments)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_a_training_step_over_two_packs_matches_packs_sorted_one_by_one(backend, sparse_batch, monkeypatch):
    """The module's one sort for all packs gives the update each pack's own sort gives."""
    together, alone = _module(backend).train(), _module(backend).train()
    alone.load_state_dict(together.state_dict())
    sf = _batch(sparse_batch, TWO_PACKS, seed=8)
    with monkeypatch.context() as patch:
        patch.setattr(PackSort, "one_sort", staticmethod(lambda device: True))  # CUDA's choice
        _step(together, sf)

    # Each pack groups its own rows at once (and what follows its sort): no shared sort.
    def group_alone(self, rows, num_rows, unique, then=None):
        groups = group_by_row(rows, num_rows, unique=unique)
        if then is not None:
            then(groups)
        return groups

    monkeypatch.setattr(PackSort, "group", group_alone)
    _step(alone, sf)
    for name, state in together.table_states().items():
        for key, tensor in state.items():
            assert torch.equal(alone.table_state(name)[key], tensor), (name, key)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["tuned", "lanes"])
@pytest.mark.parametrize("keys", [ONE_PACK, TWO_PACKS], ids=["one-pack", "two-packs"])
def test_a_cuda_training_step_from_the_loader_never_synchronizes(keys, backward, sparse_batch, monkeypatch):
    """On CUDA, torch's sync debug mode turns every host synchronization of the prepare +
    lookup + fused update of a loader-delivered batch into an error: with the device's
    tuned backward, and with the piece lanes (whose pieces are cut on the device)."""
    from recaccel.io.loader import DeviceLoader
    from recaccel.ops.embedding.triton import tuning
    from tests.helpers.loader_batches import ListReader

    if backward == "lanes":
        lanes = {"piece_len": 4, "block_pieces": 16, "unroll": 2, "num_warps": 4}
        monkeypatch.setattr(
            tuning, "lookup", lambda device, key, table=None: dict(lanes) if key.startswith("bwd_") else None
        )
    m = _module("triton", device="cuda").train()
    gen = torch.Generator().manual_seed(13)
    batches = []
    for seed in (14, 15):
        sf = _batch(sparse_batch, keys, seed=seed, index=torch.int32)
        batches.append(Batch(torch.rand(sf.batch_size, 1, generator=gen), sf, torch.rand(sf.batch_size)))
    first, second = list(DeviceLoader(ListReader(batches), "cuda", prefetch=0))
    _step(m, first.sparse)  # compiles the kernels and caches the routing
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(m, second.sparse)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    m.check_ids()
