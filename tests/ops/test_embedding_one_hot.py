"""A one-hot batch (implicit offsets) reaches the packed embedding's kernels in its ids' dtype.

``SparseFeatures(keys, values, None)`` holds one id per bag and no offsets; reading
``offsets`` would make an int64 arange. The module's preparation builds the kernels' CSR
in the ids' dtype instead (int32 for int32 ids) and never reads it. Each test compares a
module fed the one-hot int32 batch with a twin (same seed) fed the same ids as an
explicit int64 batch, bit for bit: one host, one computation, only the index dtype and
the offsets' origin differ.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.preparation import one_hot_offsets
from recaccel.sparse import SparseFeatures

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
# Two packs (dims 8 and 4); "a" and "u" share table "a" (a row shift in the pack of "b").
TABLES = [
    TableSpec("a", 6, 8, features=["a", "u"]),
    TableSpec("b", 4, 8, pooling="mean"),
    TableSpec("c", 5, 4),
]
ROWS = {"a": 6, "u": 6, "b": 4, "c": 5}
BATCH = 5


def _one_hot(seed: int, keys: list[str]) -> SparseFeatures:
    """A one-hot batch of int32 ids (implicit offsets), each id within its table."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.cat([torch.randint(0, ROWS[k], (BATCH,), generator=gen) for k in keys])
    return SparseFeatures(list(keys), values.int().to(DEVICE), None)


def _explicit(sf: SparseFeatures) -> SparseFeatures:
    """The same ids as an explicit int64 batch (its own offsets tensor)."""
    offsets = torch.arange(sf.values.numel() + 1, dtype=torch.int64, device=sf.values.device)
    return SparseFeatures(list(sf.keys), sf.values.long(), offsets)


def _module(backend: str) -> PackedEmbeddingBag:
    optim = SparseOptimConfig(lr=0.3, eps=1e-3)
    return PackedEmbeddingBag(TABLES, backend=backend, optim=optim, device=DEVICE, seed=7).train()


def _train_steps(emb: PackedEmbeddingBag, batches: list[SparseFeatures]) -> list[torch.Tensor]:
    outs = []
    for step, sf in enumerate(batches):
        out = emb.forward_concat(sf)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step)).to(out.device)
        (out * grad).sum().backward()
        outs.append(out.detach())
    return outs


def _offsets_were_made(sf: SparseFeatures) -> bool:
    # The lazy arange is cached in the instance's __dict__ on the first read of .offsets.
    return "_made" in sf.__dict__


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_int32_batch_trains_exactly_like_explicit_int64(backend: str) -> None:
    # Every feature (identity pack), and a batch missing "u" and "c" (a routed pack).
    batches = [_one_hot(1, ["a", "u", "b", "c"]), _one_hot(2, ["b", "a"]), _one_hot(3, ["c", "a", "u", "b"])]
    wide, narrow = _module(backend), _module(backend)
    wide_outs = _train_steps(wide, [_explicit(sf) for sf in batches])
    narrow_outs = _train_steps(narrow, batches)
    for w, n in zip(wide_outs, narrow_outs):
        assert torch.equal(w, n)
    for name, state in wide.table_states().items():
        for key, tensor in state.items():
            assert torch.equal(tensor, narrow.table_state(name)[key]), f"{name}.{key}"
    wide.eval(), narrow.eval()
    with torch.no_grad():
        assert torch.equal(wide.forward_concat(_explicit(batches[0])), narrow.forward_concat(batches[0]))
    assert not any(_offsets_were_made(sf) for sf in batches), "the one-hot batch's int64 offsets were made"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_one_hot_int32_batch_holds_int32_offsets(backend: str) -> None:
    sf = _one_hot(4, ["u", "c", "a", "b"])
    prepared = _module(backend).prepare(sf)
    assert prepared.offsets.dtype == torch.int32
    assert prepared.offsets.tolist() == list(range(sf.values.numel() + 1))
    packs = [pack for pack in prepared.packs if pack is not None]
    if backend == "reference":
        assert packs, "the reference backend prepares each pack's ids"
    for pack in packs:
        assert pack.ids.offsets.dtype == torch.int32 and pack.ids.rows.dtype == torch.int32
    assert not _offsets_were_made(sf)


def test_one_hot_offsets_follow_the_ids_dtype() -> None:
    assert one_hot_offsets(torch.zeros(3, dtype=torch.int32)).dtype == torch.int32
    assert one_hot_offsets(torch.zeros(3, dtype=torch.int64)).tolist() == [0, 1, 2, 3]
    assert one_hot_offsets(torch.zeros(3, dtype=torch.int64)).dtype == torch.int64


@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_one_hot_batch_stays_one_hot_through_the_deferred_check_and_trains_like_explicit() -> None:
    """The prepared batch keeps its implicit offsets (the deferred check and the long-bag
    launch skip it; an identity pack's bags are an arange), and trains bit for bit like the
    explicit int64 batch, whose offsets the deferred check does validate."""
    optim = SparseOptimConfig(lr=0.3, eps=1e-3)

    def module() -> PackedEmbeddingBag:
        return PackedEmbeddingBag(
            TABLES, backend="triton", optim=optim, device=DEVICE, seed=7, bounds_check="deferred"
        ).train()

    batches = [_one_hot(5, ["a", "u", "b", "c"]), _one_hot(6, ["b", "a"])]
    prepared = module().prepare(batches[0])
    assert prepared.one_hot and prepared.bad_ids.tolist() == [0] and prepared.offsets.dtype == torch.int32
    wide, narrow = module(), module()
    for w, n in zip(_train_steps(wide, [_explicit(sf) for sf in batches]), _train_steps(narrow, batches)):
        assert torch.equal(w, n)
    for name, state in wide.table_states().items():
        for key, tensor in state.items():
            assert torch.equal(tensor, narrow.table_state(name)[key]), f"{name}.{key}"
    wide.check_ids(), narrow.check_ids()  # no bad id counted on either


@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_one_hot_batch_launches_no_long_bag_scan(monkeypatch) -> None:
    """Past the long-bag threshold in ids, an explicit batch's forward scans its bags for
    long ones (a second launch); the same ids one-hot cannot hold a long bag: no launch, the
    same pooled rows."""
    from recaccel.ops.embedding.triton import forward as triton_forward

    launches = []
    real = triton_forward._long_bag_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_forward, "_long_bag_kernel", Counted())
    gen = torch.Generator().manual_seed(13)
    keys, rows = ["a", "u", "b", "c"], 40  # 160 ids: past the default threshold of 64
    values = torch.cat([torch.randint(0, ROWS[k], (rows,), generator=gen) for k in keys]).to(DEVICE)
    one_hot = SparseFeatures(keys, values, None)
    emb = PackedEmbeddingBag(TABLES, backend="triton", device=DEVICE, seed=7).eval()
    with torch.no_grad():
        explicit_out = emb.forward_concat(_explicit(one_hot))
        assert launches, "the explicit batch's bags were not scanned: the test checks nothing"
        launches.clear()
        assert torch.equal(emb.forward_concat(one_hot), explicit_out) and not launches
