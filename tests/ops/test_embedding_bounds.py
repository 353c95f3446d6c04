"""The deferred bounds check (``bounds_check="deferred"``): counted in the Triton lookup
kernels, raised later with the eager check's message; in-range batches bit-identical.

Triton runs under TRITON_INTERPRET=1 without CUDA (tiny shapes); the sync-free check of
a whole training step needs CUDA (``pytest -m gpu``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.errors import ConfigError
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import InvalidIdError, PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.sparse import SparseFeatures

pytestmark = [
    pytest.mark.numeric,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_interpret_enabled()),
        reason="triton kernels need CUDA or TRITON_INTERPRET=1",
    ),
]

TABLES = [
    TableSpec("a", 11, 4, pooling="mean"),
    TableSpec("b", 7, 4, features=["b1", "b2"]),
    TableSpec("s", 5, 4, optimizer="sgd"),
]
KEYS = ["b2", "s", "a", "b1"]  # two packs, interleaved
CFG = SparseOptimConfig(lr=0.1, eps=1e-3)


def _batch(sparse_batch, seed: int, keys=KEYS, batch_size: int = 3, device: str = "cpu") -> SparseFeatures:
    rows = {f: t.num_rows for t in TABLES for f in t.features}
    gen = torch.Generator().manual_seed(seed)
    return sparse_batch(rows, keys, batch_size, max_len=4, weighted=True, generator=gen, device=device)


def _with_id(sf: SparseFeatures, feature: str, value: int) -> SparseFeatures:
    """``sf`` with the last id of ``feature`` (which must have one) set to ``value``."""
    f, b = sf.keys.index(feature), sf.batch_size
    end = int(sf.offsets[(f + 1) * b])
    assert end > int(sf.offsets[f * b]), "the feature has no id"
    values = sf.values.clone()
    values[end - 1] = value
    return SparseFeatures(sf.keys, values, sf.offsets, sf.weights)


def _modules(check: object, **kwargs) -> PackedEmbeddingBag:
    return PackedEmbeddingBag(TABLES, backend="triton", optim=CFG, bounds_check=check, seed=3, **kwargs)


def _eager_message(bad: SparseFeatures) -> str:
    with pytest.raises(InvalidIdError) as eager:
        _modules(True).prepare(bad)
    return str(eager.value)


def _train_step(m: PackedEmbeddingBag, sf: SparseFeatures, seed: int) -> torch.Tensor:
    out = m(sf)
    # Drawn where it is used: a host-to-device copy is a synchronization, which the sync
    # debug mode of the GPU test would reject (the CPU draws are unchanged).
    gen = torch.Generator(out.device).manual_seed(seed)
    grad = torch.randn(out.shape, generator=gen, device=out.device)
    (out * grad).sum().backward()
    return out.detach()


def test_an_out_of_range_id_is_reported_with_the_eager_message_at_the_next_lookup(sparse_batch):
    good = _batch(sparse_batch, seed=1)
    bad = _with_id(_batch(sparse_batch, seed=2), "a", 11)
    m = _modules("deferred")
    m(bad)  # the kernels count the id; nothing waits for the count
    with pytest.raises(InvalidIdError) as deferred:
        m(good)
    assert str(deferred.value) == _eager_message(bad)
    assert "feature 'a': id 11 at batch row" in str(deferred.value) and "[0, 11)" in str(deferred.value)
    m(good)  # raised once; the next batches are looked up again


def test_a_negative_id_in_a_long_bag_is_counted(sparse_batch):
    # 63 one-id bags and one of 100 ids: past the long threshold (64 at this mean length),
    # so the long-bag kernel reads it.
    values = torch.arange(163) % 7
    values[120] = -3
    bad = SparseFeatures.from_lengths(["b1"], values, torch.tensor([1] * 63 + [100]))
    m = _modules("deferred")
    m(bad)
    with pytest.raises(InvalidIdError) as deferred:
        m.check_ids()
    assert str(deferred.value) == _eager_message(bad)


@pytest.mark.parametrize("reader", ["check_ids", "state_dict"])
def test_check_ids_and_state_dict_raise_a_pending_bad_id(reader, sparse_batch):
    bad = _with_id(_batch(sparse_batch, seed=3), "b1", 7)
    m = _modules("deferred").train()
    _train_step(m, bad, seed=30)
    with pytest.raises(InvalidIdError, match=r"feature 'b1': id 7 at batch row \d is out of range \[0, 7\)"):
        getattr(m, reader)()
    m.check_ids()  # nothing pending any more


def test_an_out_of_range_id_reads_row_zero_of_its_table(sparse_batch):
    sf = _batch(sparse_batch, seed=4)
    m = _modules("deferred").eval()
    got = m(_with_id(sf, "a", 500))
    with pytest.raises(InvalidIdError, match="id 500"):
        m.check_ids()
    want = m(_with_id(sf, "a", 0))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_malformed_offsets_are_reported_by_the_deferred_check(sparse_batch):
    sf = _batch(sparse_batch, seed=5)
    offsets = sf.offsets.clone()
    offsets[2] = offsets[-1] + 5  # past the ids, then decreasing
    bad = SparseFeatures(sf.keys, sf.values, offsets, sf.weights)
    m = _modules("deferred")
    m(bad)  # the kernels read a valid CSR in the offsets' place
    with pytest.raises(InvalidIdError, match="malformed sparse offsets") as deferred:
        m.check_ids()
    assert str(deferred.value) == _eager_message(bad)


@pytest.mark.parametrize(
    "offsets",
    [[0, 2, 5, 3, 6], [1, 2, 3, 4, 6], [0, 2, 3, 4, 9], [0, -4, 3, 4, 6], [0, 2, 3, 4, 5]],
    ids=["decreasing", "first-not-zero", "past-the-ids", "negative", "short-of-the-ids"],
)
def test_the_deferred_check_counts_malformed_offsets_and_hands_the_kernels_a_valid_csr(offsets):
    from recaccel.ops.embedding.deferred_check import defer_batch_check

    values = torch.arange(6)
    sf = SparseFeatures(["x", "y"], values, torch.tensor(offsets))
    safe, counter = defer_batch_check(sf)
    assert counter.tolist() == [1] and safe.values is values
    assert safe.offsets.tolist() == [0, 0, 0, 0, 6]  # every id in the last bag: in bounds


def test_the_deferred_check_leaves_valid_offsets_as_they_are():
    from recaccel.ops.embedding.deferred_check import defer_batch_check

    offsets = torch.tensor([0, 0, 3, 3, 6], dtype=torch.int32)
    safe, counter = defer_batch_check(SparseFeatures(["x", "y"], torch.arange(6), offsets))
    assert (
        counter.tolist() == [0] and torch.equal(safe.offsets, offsets) and safe.offsets.dtype == torch.int32
    )


def test_the_deferred_check_takes_a_one_hot_batch_as_it_is_and_counts_its_bad_ids():
    """Implicit offsets are valid by construction: the batch passes untouched (no offsets
    made) with a zero counter of its own, and an id past its table is still counted."""
    from recaccel.ops.embedding.deferred_check import defer_batch_check

    sf = SparseFeatures(["x", "y"], torch.arange(6), None)
    safe, counter = defer_batch_check(sf)
    assert safe is sf and safe.one_hot and counter.tolist() == [0] and counter.dtype == torch.int32
    assert defer_batch_check(sf)[1] is not counter  # one counter per batch
    tables = [TableSpec("x", 4, 3), TableSpec("y", 4, 3)]
    m = PackedEmbeddingBag(tables, backend="triton", optim=CFG, bounds_check="deferred", seed=3)
    m(SparseFeatures(["x", "y"], torch.tensor([0, 1, 3, 2, 9, 1]), None))  # y's second id past its 4 rows
    with pytest.raises(InvalidIdError, match="feature 'y': id 9 at batch row 1"):
        m.check_ids()


@pytest.mark.parametrize("optimizer_seed", [10, 20])
def test_in_range_training_steps_are_bit_identical_to_the_eager_check(optimizer_seed, sparse_batch):
    deferred, eager = _modules("deferred").train(), _modules(True).train()
    for step in range(3):
        sf = _batch(sparse_batch, seed=optimizer_seed + step, batch_size=4)
        assert torch.equal(_train_step(deferred, sf, step), _train_step(eager, sf, step))
        ready = deferred.prepare(sf)  # a prepared batch too, looked up by rows
        assert torch.equal(deferred.lookup_rows(ready, 1, 3), eager.lookup_rows(sf, 1, 3))
    deferred.check_ids()
    for name, state in eager.table_states().items():
        for key, tensor in state.items():
            assert torch.equal(deferred.table_state(name)[key], tensor), (name, key)


def test_the_reference_backend_defers_the_check_to_its_preparation_and_reads_row_zero(sparse_batch):
    sf = _batch(sparse_batch, seed=6)
    bad = _with_id(sf, "a", 11)
    m = PackedEmbeddingBag(TABLES, backend="reference", bounds_check="deferred", seed=3).eval()
    got = m(bad)  # counted by the preparation, read later
    with pytest.raises(InvalidIdError) as deferred:
        m.check_ids()
    assert str(deferred.value) == _eager_message(bad)
    torch.testing.assert_close(got, m(_with_id(sf, "a", 0)), rtol=0, atol=0)


def test_bounds_check_rejects_an_unknown_mode():
    with pytest.raises(
        ConfigError, match="bounds_check must be True, False, 'eager', 'deferred' or 'auto', got 'lazy'"
    ):
        _modules("lazy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_deferred_training_step_never_synchronizes_with_the_host(sparse_batch):
    keys = ["b1", "b2"]  # one pack, the batch's CSR as is: no per-pack id count to read
    m = _modules("deferred", device="cuda").train()
    batches = [_batch(sparse_batch, seed=40 + i, keys=keys, batch_size=64, device="cuda") for i in range(3)]
    _train_step(m, batches[0], seed=0)  # compiles and warms the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, sf in enumerate(batches[1:]):
            _train_step(m, m.prepare(sf), seed=i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    m.check_ids()
