"""int32 and int64 ids give the same lookups and updates on every packed backend.

A batch's ids and offsets reach the kernels in the dtype they arrive in (int32 from the
reader, int64 elsewhere): the module does not widen them. Each test runs one module on a
batch with int64 ids and a twin module (same seed) on the same batch with int32 ids and
compares forward outputs, gradients and the tables after the fused update, bit for bit
(one host, one computation: only the index dtype differs).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import (
    EmbeddingOptions,
    InvalidIdError,
    PackedEmbeddingBag,
    SparseOptimConfig,
    TableSpec,
)
from recaccel.ops.embedding.cache import CacheOptions
from recaccel.ops.embedding.packing import gather_pack_ids
from recaccel.sparse import SparseFeatures
from tests.helpers.ops_inputs import random_sparse_batch

HAS_TRITON = torch.cuda.is_available() or triton_interpret_enabled()
HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
BACKENDS = [
    "reference",
    pytest.param("fbgemm", marks=pytest.mark.skipif(not HAS_FBGEMM, reason="needs fbgemm_gpu")),
    pytest.param(
        "triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
    ),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Two tables share the dim-8 pack (row shift), one pools by mean, "u" is a second feature
# of table "a"; dims are multiples of 4 for FBGEMM.
TABLES = [
    TableSpec("a", 6, 8, features=["a", "u"]),
    TableSpec("b", 4, 8, pooling="mean"),
    TableSpec("c", 5, 4),
]
ROWS = {"a": 6, "u": 6, "b": 4, "c": 5}
BATCH = 5


def _batch(seed: int, keys: list[str], *, weighted: bool = True) -> SparseFeatures:
    gen = torch.Generator().manual_seed(seed)
    return random_sparse_batch(ROWS, keys, BATCH, max_len=3, weighted=weighted, generator=gen, device=DEVICE)


def _narrow(sf: SparseFeatures, *, offsets: bool = True) -> SparseFeatures:
    """``sf`` with int32 ids (and int32 offsets unless ``offsets`` is False)."""
    off = sf.offsets.int() if offsets else sf.offsets
    return SparseFeatures(sf.keys, sf.values.int(), off, sf.weights)


def _module(backend: str, **settings) -> PackedEmbeddingBag:
    optim = SparseOptimConfig(lr=0.3, eps=1e-3)
    options = EmbeddingOptions(backend=backend, optim=optim, **settings)
    emb = PackedEmbeddingBag(TABLES, options, device=DEVICE, seed=7)
    return emb.train()


def _train_steps(emb: PackedEmbeddingBag, batches: list[SparseFeatures]) -> list[torch.Tensor]:
    outs = []
    for step, sf in enumerate(batches):
        out = emb.forward_concat(sf)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step)).to(out.device)
        (out * grad).sum().backward()
        outs.append(out.detach())
    return outs


def _assert_same_tables(a: PackedEmbeddingBag, b: PackedEmbeddingBag) -> None:
    for name, state in a.table_states().items():
        for key, tensor in state.items():
            assert torch.equal(tensor, b.table_state(name)[key]), f"{name}.{key}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_int32_ids_train_exactly_like_int64_ids(backend: str, optimizer: str) -> None:
    tables = [dataclasses.replace(t, optimizer=optimizer) for t in TABLES]
    wide = PackedEmbeddingBag(tables, backend=backend, device=DEVICE, seed=7, optim=SparseOptimConfig(lr=0.3))
    narrow = PackedEmbeddingBag(
        tables, backend=backend, device=DEVICE, seed=7, optim=SparseOptimConfig(lr=0.3)
    )
    # Batches with every feature, and one missing "u" and "c" (a routed, non-identity pack).
    batches = [_batch(1, ["a", "u", "b", "c"]), _batch(2, ["b", "a"]), _batch(3, ["c", "a", "u", "b"])]
    wide_outs = _train_steps(wide.train(), batches)
    narrow_outs = _train_steps(narrow.train(), [_narrow(sf) for sf in batches])
    for w, n in zip(wide_outs, narrow_outs):
        assert torch.equal(w, n)
    _assert_same_tables(wide, narrow)
    # Evaluation after the updates reads the same rows.
    wide.eval(), narrow.eval()
    with torch.no_grad():
        assert torch.equal(wide.forward_concat(batches[0]), narrow.forward_concat(_narrow(batches[0])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_ids_with_int64_offsets_pool_like_int64(backend: str) -> None:
    wide, narrow = _module(backend), _module(backend)
    sf = _batch(4, ["u", "c", "a", "b"])
    outs = _train_steps(wide, [sf]) + _train_steps(narrow, [_narrow(sf, offsets=False)])
    assert torch.equal(outs[0], outs[1])
    _assert_same_tables(wide, narrow)


@pytest.mark.parametrize(
    "backend",
    ["reference", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))],
)
def test_int32_ids_give_the_same_autograd_gradients(backend: str) -> None:
    wide, narrow = _module(backend, mode="autograd"), _module(backend, mode="autograd")
    sf = _batch(5, ["a", "b", "c", "u"])
    for emb, batch in ((wide, sf), (narrow, _narrow(sf))):
        out = emb.forward_concat(batch)
        (out * torch.arange(out.numel(), dtype=out.dtype, device=out.device).view(out.shape)).sum().backward()
    for (name, p), (_, q) in zip(wide.named_parameters(), narrow.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize(
    "backend",
    ["reference", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))],
)
def test_int32_ids_micro_batches_and_deferred_update_match_int64(backend: str) -> None:
    wide, narrow = _module(backend), _module(backend)
    sf = _batch(6, ["a", "b", "u"])  # one dim: micro-batches pool [B, F, D]
    grads = []
    for emb, batch in ((wide, sf), (narrow, _narrow(sf))):
        prepared = emb.prepare(batch)
        parts = [emb.lookup_rows(prepared, lo, hi) for lo, hi in ((0, 2), (2, BATCH))]
        full = torch.cat(parts)
        grads.append(full)
        emb.apply_gradient(prepared, torch.ones_like(full))
    assert torch.equal(grads[0], grads[1])
    _assert_same_tables(wide, narrow)


def test_the_prepared_batch_keeps_int32_ids_to_the_kernels() -> None:
    emb = _module("reference")
    sf = _narrow(_batch(7, ["a", "u", "b", "c"]))
    prepared = emb.prepare(sf)
    assert prepared.values.dtype == torch.int32 and prepared.offsets.dtype == torch.int32
    ids = prepared.packs[0].ids  # the dim-8 pack: shifted rows of "a", "u" and "b"
    assert ids.rows.dtype == torch.int32 and ids.offsets.dtype == torch.int32
    # Narrower integers are widened, and int32 ids with int64 offsets go to int64 together.
    assert (
        emb.prepare(SparseFeatures(sf.keys, sf.values.short(), sf.offsets, None)).values.dtype == torch.int64
    )
    mixed = emb.prepare(_narrow(_batch(7, ["a", "u", "b", "c"]), offsets=False))
    assert mixed.packs[0].ids.rows.dtype == torch.int64 and mixed.packs[0].ids.offsets.dtype == torch.int64


def test_a_pack_wider_than_int32_rows_gets_int64_rows_from_int32_ids() -> None:
    emb = _module("reference")
    sf = _narrow(_batch(8, ["a", "b"]))
    local = dataclasses.replace(emb.plan.route(sf.keys, sf.values.device).packs[0].local, wide_rows=True)
    ids = gather_pack_ids(sf, local, BATCH)
    assert ids.rows.dtype == torch.int64 and ids.offsets.dtype == torch.int64
    narrow = gather_pack_ids(sf, dataclasses.replace(local, wide_rows=False), BATCH)
    assert torch.equal(ids.rows, narrow.rows.long()) and torch.equal(ids.offsets, narrow.offsets.long())


@pytest.mark.parametrize("bounds_check", [True, "deferred"])
@pytest.mark.parametrize(
    "backend",
    ["reference", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))],
)
def test_an_out_of_range_int32_id_raises_the_usual_error(backend: str, bounds_check) -> None:
    emb = _module(backend, bounds_check=bounds_check)
    sf = _narrow(_batch(9, ["a", "b"]))
    values = sf.values.clone()
    values[0] = 6  # table "a" has rows 0..5
    with pytest.raises(InvalidIdError, match=r"id 6 .*out of range \[0, 6\) of table 'a'"):
        with torch.no_grad():
            emb.eval()(SparseFeatures(sf.keys, values, sf.offsets, sf.weights))
        emb.check_ids()


def test_host_placed_tables_take_int32_ids() -> None:
    host = [dataclasses.replace(t, placement="host") for t in TABLES]
    options = EmbeddingOptions(backend="reference", cache=CacheOptions(fraction=1.0, window=1))
    wide = PackedEmbeddingBag(host, options, device=DEVICE, seed=7)
    narrow = PackedEmbeddingBag(host, options, device=DEVICE, seed=7)
    batches = [_batch(10, ["a", "u", "b", "c"]), _batch(11, ["b", "c"])]
    for w, n in zip(
        _train_steps(wide.train(), batches), _train_steps(narrow.train(), [_narrow(b) for b in batches])
    ):
        assert torch.equal(w, n)
    _assert_same_tables(wide, narrow)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_300_id_bag_of_int32_ids_pools_and_trains_like_int64(backend: str) -> None:
    gen = torch.Generator().manual_seed(12)
    lengths = torch.randint(0, 3, (2 * BATCH,), generator=gen)
    lengths[BATCH + 1] = 300  # a mean-pooled bag long enough for the Triton long-bag path
    counts = [int(part.sum()) for part in lengths.split(BATCH)]
    ids = torch.cat([torch.randint(0, ROWS[k], (n,), generator=gen) for k, n in zip(["a", "b"], counts)])
    sf = SparseFeatures.from_lengths(["a", "b"], ids, lengths).to(DEVICE)
    wide, narrow = _module(backend), _module(backend)
    outs = _train_steps(wide, [sf, sf]) + _train_steps(narrow, [_narrow(sf), _narrow(sf)])
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    _assert_same_tables(wide, narrow)
