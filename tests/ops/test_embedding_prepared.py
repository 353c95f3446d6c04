"""Prepared lookups of the packed embedding bag: PreparedSparse, lookup_rows, apply_gradient.

A batch prepared ahead (``prepare``) must give what the same batch gives unprepared, bit
for bit, forward and fused update; ``lookup_rows`` must give the rows of the forward and
``apply_gradient`` the update of the forward's backward. Every comparison is between two
modules built alike (same seed), one driven each way, on fresh random batches with empty
bags, duplicate ids, mean pooling and per-id weights. Triton runs under
TRITON_INTERPRET=1 without CUDA (tiny shapes).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.errors import ConfigError
from recaccel.ops.backend import fbgemm_installed, triton_interpret_enabled
from recaccel.ops.embedding import (
    InvalidIdError,
    PackedEmbeddingBag,
    PreparedSparse,
    SparseOptimConfig,
    TableSpec,
)
from recaccel.sparse import SparseFeatures

pytestmark = pytest.mark.numeric


needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
needs_fbgemm = pytest.mark.skipif(not fbgemm_installed(), reason="fbgemm_gpu is not installed")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
CFG = SparseOptimConfig(lr=0.1, eps=1e-3, weight_decay=0.01)
KEYS = ["b2", "s", "a", "b1"]  # two packs, interleaved: the outputs are restored to batch order


def _tables(optimizer: str = "rowwise_adagrad") -> list[TableSpec]:
    """One dim, two packs (a mean table and a shared table; a table of another optimizer)."""
    other = "adam" if optimizer == "sgd" else "sgd"
    return [
        TableSpec("a", 11, 4, pooling="mean", optimizer=optimizer),
        TableSpec("b", 7, 4, features=["b1", "b2"], optimizer=optimizer),
        TableSpec("s", 5, 4, optimizer=other),
    ]


MIXED = [
    TableSpec("a", 11, 4, pooling="mean"),
    TableSpec("b", 7, 4, features=["b1", "b2"]),
    TableSpec("c", 5, 8, optimizer="adam"),
    TableSpec("d", 9, 8, pooling="mean", optimizer="sgd"),
]
MIXED_KEYS = ["b2", "c", "a", "d", "b1"]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """CPU everywhere; CUDA in the GPU suite (``pytest -m gpu``)."""
    return request.param


def _runnable(backend: str, device: str) -> None:
    if backend == "triton" and device == "cpu" and not triton_interpret_enabled():
        pytest.skip("triton on CPU runs only under TRITON_INTERPRET=1")


def _batch(tables, keys, make, seed, batch_size=3, max_len=4, weighted=True, device="cpu"):
    rows = {f: t.num_rows for t in tables for f in t.features}
    gen = torch.Generator().manual_seed(seed)
    return make(rows, keys, batch_size, max_len=max_len, weighted=weighted, generator=gen, device=device)


def _twins(tables, backend, **kwargs) -> tuple[PackedEmbeddingBag, PackedEmbeddingBag]:
    make = lambda: PackedEmbeddingBag(tables, backend=backend, optim=CFG, seed=5, **kwargs)  # noqa: E731
    return make(), make()


def _grad(shape, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _assert_same_state(got: PackedEmbeddingBag, want: PackedEmbeddingBag) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for k in want_sd:
        assert torch.equal(got_sd[k], want_sd[k]), k


def _train_step(m: PackedEmbeddingBag, sf: SparseFeatures, seed: int, lookup="forward") -> torch.Tensor:
    out = getattr(m, lookup)(sf)
    if isinstance(out, list):
        (sum((o * _grad(o.shape, seed + i, o.device)).sum() for i, o in enumerate(out))).backward()
        return torch.cat([o.detach().flatten() for o in out])
    out.backward(_grad(out.shape, seed, out.device))
    return out.detach()


# ------------------------------------------------------------ prepared == unprepared


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_prepared_training_steps_are_bit_identical(backend, optimizer, device, sparse_batch):
    _runnable(backend, device)
    tables = _tables(optimizer)
    plain, prepared = _twins(tables, backend, device=device)
    for step in range(2):  # a second step: Adam's t and the optimizer state carry over
        sf = _batch(tables, KEYS, sparse_batch, seed=10 + step, device=device)
        ready = prepared.prepare(sf)
        assert isinstance(ready, PreparedSparse) and ready.training
        assert torch.equal(_train_step(prepared, ready, step), _train_step(plain, sf, step))
        _assert_same_state(prepared, plain)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_prepared_16bit_steps_are_bit_identical(backend, dtype, device, sparse_batch):
    _runnable(backend, device)
    if backend == "triton" and dtype == "fp16" and device == "cpu":
        pytest.skip("one 16-bit dtype on the interpreter is enough")
    tables = _tables("adam")
    plain, prepared = _twins(tables, backend, dtype=dtype, device=device)
    for step in range(2):
        sf = _batch(tables, KEYS, sparse_batch, seed=20 + step, device=device)
        assert torch.equal(_train_step(prepared, prepared.prepare(sf), step), _train_step(plain, sf, step))
        _assert_same_state(prepared, plain)  # rows, state and the rounding generator


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lookup", ["forward_concat", "forward_packs"])
def test_prepared_mixed_dims_are_bit_identical(backend, lookup, sparse_batch):
    plain, prepared = _twins(MIXED, backend)
    sf = _batch(MIXED, MIXED_KEYS, sparse_batch, seed=30)
    assert torch.equal(
        _train_step(prepared, prepared.prepare(sf), 3, lookup), _train_step(plain, sf, 3, lookup)
    )
    _assert_same_state(prepared, plain)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "batch_size, max_len, weighted",
    [(1, 5, False), (3, 0, True), (4, 6, False)],
    ids=["batch_of_one", "all_bags_empty", "many_duplicates"],
)
def test_prepared_edge_cases_are_bit_identical(backend, batch_size, max_len, weighted, sparse_batch):
    tables = _tables()
    plain, prepared = _twins(tables, backend)
    sf = _batch(
        tables, KEYS, sparse_batch, seed=40, batch_size=batch_size, max_len=max_len, weighted=weighted
    )
    assert torch.equal(_train_step(prepared, prepared.prepare(sf), 4), _train_step(plain, sf, 4))
    _assert_same_state(prepared, plain)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_prepared_autograd_mode_gradients_are_bit_identical(backend, sparse_grad, sparse_batch):
    plain, prepared = _twins(MIXED, backend, mode="autograd", sparse_grad=sparse_grad)
    sf = _batch(MIXED, MIXED_KEYS, sparse_batch, seed=50)
    assert torch.equal(
        _train_step(prepared, prepared.prepare(sf), 5, "forward_concat"),
        _train_step(plain, sf, 5, "forward_concat"),
    )
    for (name, g), (_, w) in zip(prepared.named_parameters(), plain.named_parameters()):
        assert torch.equal(g.grad.to_dense(), w.grad.to_dense()), name


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("fbgemm", marks=needs_fbgemm)])
def test_prepared_eval_lookup_is_bit_identical(backend, sparse_batch):
    tables = _tables("sgd")
    tables = [t for t in tables if t.optimizer == "sgd"] if backend == "fbgemm" else tables  # no Adam there
    keys = [k for k in KEYS if any(k in t.features for t in tables)]
    m = PackedEmbeddingBag(tables, backend=backend, optim=SparseOptimConfig(lr=0.1), seed=5).eval()
    sf = _batch(tables, keys, sparse_batch, seed=60)
    ready = m.prepare(sf)
    assert not ready.training
    assert torch.equal(m(ready), m(sf))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_batch_is_not_prepared_again(backend, device, sparse_batch, monkeypatch):
    """Lookups, backward, lookup_rows and apply_gradient of a prepared batch neither
    validate, check nor gather its ids again, nor sort them for the backward."""
    from recaccel.ops.embedding import packing, prepared, reference, row_groups
    from recaccel.ops.embedding.triton import autograd, backward, pack_ids

    _runnable(backend, device)
    tables = _tables("adam")
    m = PackedEmbeddingBag(tables, backend=backend, optim=CFG, seed=5, device=device)
    ready = m.prepare(_batch(tables, KEYS, sparse_batch, seed=65, device=device))

    def forbidden(*args, **kwargs):
        raise AssertionError("id work on a prepared batch")

    monkeypatch.setattr(m, "_prepare", forbidden)
    for module, names in [
        (packing, ["gather_pack_ids"]),
        (row_groups, ["group_by_row", "group_packs"]),
        (prepared, ["gather_pack_ids", "group_by_row"]),
        (reference, ["group_by_row"]),
        (autograd, ["backward_pack_ids", "group_by_row"]),
        (backward, ["group_by_row"]),
        (pack_ids, ["fused_pack_ids"]),
    ]:
        for name in names:
            monkeypatch.setattr(module, name, forbidden)
    out = m(ready)
    out.backward(_grad(out.shape, 0, device))
    m.forward_concat(ready)
    m.lookup_rows(ready, 1, 3)
    m.apply_gradient(ready, _grad(out.shape, 1, device))


# ------------------------------------------------------------ lookup_rows


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("fbgemm", marks=needs_fbgemm)])
@pytest.mark.parametrize("training", [True, False])
def test_lookup_rows_are_the_forward_rows(backend, training, device, sparse_batch):
    _runnable(backend, device)
    tables = [t for t in _tables("sgd") if t.optimizer == "sgd"] if backend == "fbgemm" else _tables()
    keys = [k for k in KEYS if any(k in t.features for t in tables)]
    cfg = SparseOptimConfig(lr=0.1)
    m = PackedEmbeddingBag(tables, backend=backend, optim=cfg, seed=5, device=device).train(training)
    sf = _batch(tables, keys, sparse_batch, seed=70, batch_size=5, device=device)
    ready = m.prepare(sf)
    with torch.no_grad():
        whole = m(sf)
    for lo, hi in [(0, 5), (0, 2), (2, 5), (3, 4), (4, 4)]:
        rows = m.lookup_rows(ready, lo, hi)
        assert rows.shape == (hi - lo, len(keys), 4) and not rows.requires_grad
        if backend == "fbgemm":  # the TBE runs on a cut batch
            torch.testing.assert_close(rows, whole[lo:hi])
        else:
            assert torch.equal(rows, whole[lo:hi]), (lo, hi)
    with pytest.raises(ValueError, match=r"rows \[3, 6\)"):
        m.lookup_rows(ready, 3, 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookup_rows_of_an_unprepared_batch(backend, sparse_batch):
    tables = _tables()
    m = PackedEmbeddingBag(tables, backend=backend, seed=5)
    sf = _batch(tables, KEYS, sparse_batch, seed=71, batch_size=2, weighted=False)
    with torch.no_grad():
        assert torch.equal(m.lookup_rows(sf, 1, 2), m(sf)[1:2])
    with pytest.raises(ValueError, match="one dim"):
        m2 = PackedEmbeddingBag(MIXED, backend=backend, seed=5)
        m2.lookup_rows(m2.prepare(_batch(MIXED, MIXED_KEYS, sparse_batch, seed=72)), 0, 1)


# ------------------------------------------------------------ apply_gradient


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_apply_gradient_is_the_fused_backward(backend, optimizer, device, sparse_batch):
    _runnable(backend, device)
    tables = _tables(optimizer)
    eager, deferred = _twins(tables, backend, device=device)
    for step in range(2):
        sf = _batch(tables, KEYS, sparse_batch, seed=80 + step, batch_size=4, device=device)
        out = eager(sf)
        grad = _grad(out.shape, step, device)
        out.backward(grad)
        # Micro-batches: rows looked up in two parts, the update once for the whole batch.
        ready = deferred.prepare(sf)
        parts = torch.cat([deferred.lookup_rows(ready, 0, 1), deferred.lookup_rows(ready, 1, 4)])
        assert torch.equal(parts, out.detach())
        deferred.apply_gradient(ready, grad)
        _assert_same_state(deferred, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_gradient_16bit_draws_the_same_rounding_seeds(backend, device, sparse_batch):
    """Two 16-bit packs: the seeds are drawn in autograd's order of the packs' backwards."""
    _runnable(backend, device)
    tables = _tables("adam")
    eager, deferred = _twins(tables, backend, dtype="bf16", device=device)
    for step in range(2):
        sf = _batch(tables, KEYS, sparse_batch, seed=90 + step, device=device)
        out = eager(sf)
        grad = _grad(out.shape, step, device)
        out.backward(grad)
        deferred.apply_gradient(deferred.prepare(sf), grad)
        _assert_same_state(deferred, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_gradient_edge_cases(backend, sparse_batch):
    tables = _tables()
    eager, deferred = _twins(tables, backend)
    for seed, (batch_size, max_len) in enumerate([(1, 3), (3, 0), (2, 6)]):
        sf = _batch(tables, KEYS, sparse_batch, seed=100 + seed, batch_size=batch_size, max_len=max_len)
        out = eager(sf)
        grad = _grad(out.shape, seed)
        out.backward(grad)
        deferred.apply_gradient(sf, grad)  # unprepared: prepared here
        _assert_same_state(deferred, eager)
    one = _batch(tables, ["a"], sparse_batch, seed=110)  # a pack with no feature: not stepped
    out = eager(one)
    grad = _grad(out.shape, 7)
    out.backward(grad)
    deferred.apply_gradient(deferred.prepare(one), grad)
    _assert_same_state(deferred, eager)
    with pytest.raises(ValueError, match=r"grad has shape \(2, 1, 4\)"):
        deferred.apply_gradient(one, grad[:2])


@pytest.mark.parametrize(
    "backend, mode, match",
    [
        ("reference", "autograd", "mode='autograd'"),
        pytest.param("triton", "autograd", "mode='autograd'", marks=needs_triton),
        pytest.param("fbgemm", "fused", "backend='fbgemm'", marks=needs_fbgemm),
    ],
)
def test_deferred_update_unsupported(backend, mode, match, sparse_batch):
    tables = [TableSpec("t", 6, 4)]
    m = PackedEmbeddingBag(tables, backend=backend, mode=mode, seed=1)
    reason = m.deferred_update_unsupported()
    assert reason is not None and match in reason
    sf = _batch(tables, ["t"], sparse_batch, seed=1)
    with pytest.raises(ConfigError, match=r"apply_gradient: .*" + match):
        m.apply_gradient(m.prepare(sf), torch.zeros(3, 1, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_update_supported_in_fused_mode(backend):
    assert PackedEmbeddingBag([TableSpec("t", 6, 4)], backend=backend).deferred_update_unsupported() is None


# ------------------------------------------------------------ preparations that do not fit


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_prepared_elsewhere_is_prepared_again(backend, sparse_batch, monkeypatch):
    tables = _tables()
    plain, used = _twins(tables, backend)
    other = PackedEmbeddingBag(tables, backend=backend, seed=6)  # another module, other rows
    sf = _batch(tables, KEYS, sparse_batch, seed=120)
    foreign = other.prepare(sf)
    other.eval()
    eval_made = used.eval().prepare(sf)
    used.train()
    calls = []
    original = used._prepare
    monkeypatch.setattr(used, "_prepare", lambda s, t: calls.append(t) or original(s, t))
    for i, batch in enumerate([foreign, eval_made]):
        assert torch.equal(_train_step(used, batch, i), _train_step(plain, sf, i))
        _assert_same_state(used, plain)
    assert calls == [True, True]  # both prepared again, for training
    # A training preparation serves an eval lookup as is.
    ready = used.prepare(sf)
    calls.clear()
    used.eval()
    assert torch.equal(used(ready), plain.eval()(sf))
    assert calls == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ids_raise_from_prepare(backend, sparse_batch):
    tables = _tables()
    m = PackedEmbeddingBag(tables, backend=backend, seed=5)
    sf = _batch(tables, ["a"], sparse_batch, seed=130, max_len=3)
    values = sf.values.clone()
    values[-1] = 11
    bad = SparseFeatures(sf.keys, values, sf.offsets, sf.weights)
    with pytest.raises(InvalidIdError, match=r"feature 'a': id 11 at batch row \d is out of range \[0, 11\)"):
        m.prepare(bad)


def test_batch_operations_keep_or_drop_the_preparation(sparse_batch):
    tables = _tables()
    m = PackedEmbeddingBag(tables, backend="reference", seed=5)
    ready = m.prepare(_batch(tables, KEYS, sparse_batch, seed=140))
    assert ready.reorder(KEYS) is ready and ready.select(KEYS) is ready
    for derived in [ready.reorder(KEYS[::-1]), ready.slice_rows(0, 2), ready.to("cpu"), ready.select(["a"])]:
        assert type(derived) is SparseFeatures


def test_tensors_cover_the_preparation(device, sparse_batch):
    """record_stream reaches every tensor a lookup, its backward and apply_gradient read."""
    tables = _tables()
    m = PackedEmbeddingBag(tables, backend="reference", seed=5, device=device)
    ready = m.prepare(_batch(tables, KEYS, sparse_batch, seed=150, device=device))
    held = {id(t) for t in ready.tensors()}
    for pack in ready.packs:
        for t in (pack.ids.rows, pack.ids.offsets, pack.ids.scale, pack.ids.bags, *pack.groups):
            assert id(t) in held
    assert id(ready.routing.order) in held and id(ready.values) in held
    ready.record_stream(torch.cuda.current_stream() if device == "cuda" else None)  # CPU: nothing to mark


def _grouping_as_before(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row grouping as it was made before int32 keys: int64 sort, unique_consecutive."""
    sorted_rows, order = torch.sort(rows, stable=True)
    unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    return order, unique_rows, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])


@pytest.mark.parametrize("num_rows, n", [(3, 200), (1000, 50), (2**31, 64), (2**31 + 1, 64), (5, 0)])
@pytest.mark.parametrize("unique", [True, False])
def test_row_grouping_with_int32_keys_equals_the_int64_grouping(num_rows, n, unique):
    from recaccel.ops.embedding.row_groups import group_by_row

    gen = torch.Generator().manual_seed(num_rows + n)
    rows = torch.randint(0, num_rows, (n,), generator=gen, dtype=torch.int64)
    groups = group_by_row(rows, num_rows, unique=unique)
    assert groups.sorted_rows.dtype == (torch.int32 if num_rows <= 2**31 else torch.int64)
    # Made now only when asked: what the Triton fused update's preparation skips.
    assert len(groups.tensors()) == (4 if unique else 2)
    order, unique_rows, segments = groups  # order-only groupings make the rest on access
    want = _grouping_as_before(rows)
    for got, expected in zip((order, unique_rows, segments), want):
        assert got.dtype == torch.int64 and torch.equal(got, expected)


@needs_triton
def test_a_triton_fused_preparation_sorts_without_unique_rows(sparse_batch):
    tables = _tables()
    m = PackedEmbeddingBag(tables, backend="triton", seed=5).train()
    ready = m.prepare(_batch(tables, KEYS, sparse_batch, seed=160))
    for pack in ready.packs:
        assert pack.groups.sorted_rows.dtype == torch.int32
        assert len(pack.groups.tensors()) == 2  # order and keys: no unique_consecutive ran
        assert torch.equal(pack.groups.order, _grouping_as_before(pack.ids.rows)[0])
