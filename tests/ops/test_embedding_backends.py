"""Packed embedding bag: the Triton and FBGEMM backends against the reference.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set here and in
conftest.py before the kernel module is imported), on tiny shapes. GPU-marked tests run
the same comparisons at real sizes on CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import io

import pytest

from recaccel.errors import ConfigError
from recaccel.ops.backend import fbgemm_installed, triton_interpret_enabled
from recaccel.ops.embedding import InvalidIdError, PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.sparse import SparseFeatures

pytestmark = pytest.mark.numeric


needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
needs_fbgemm = pytest.mark.skipif(not fbgemm_installed(), reason="fbgemm_gpu is not installed")
BACKENDS = [pytest.param("triton", marks=needs_triton), pytest.param("fbgemm", marks=needs_fbgemm)]
CFG = SparseOptimConfig(lr=0.1, eps=1e-3)
CFG_DECAY = SparseOptimConfig(lr=0.1, eps=1e-3, weight_decay=0.01)

MIXED = [
    TableSpec("a", 11, 4, pooling="mean"),
    TableSpec("b", 7, 4, features=["b1", "b2"]),
    TableSpec("c", 5, 8),
    TableSpec("d", 9, 8, pooling="mean"),
]
MANY = [TableSpec(f"t{i}", 2 + i % 5, 4) for i in range(1000)]
ALL_MANY_KEYS = [t.name for t in MANY]
# The interpreter runs ~100 kernel programs a second: 40 of the 1000 features, shuffled.
SOME_MANY_KEYS = [f"t{(i * 397) % 1000}" for i in range(40)]
# name -> (tables, keys, batch size, max bag length, per-id weights)
CASES = {
    "mixed_dims_shared_mean_weighted": (MIXED, ["b2", "c", "a", "d", "b1"], 3, 4, True),
    "one_table_batch_of_one": ([TableSpec("t", 6, 4)], ["t"], 1, 6, False),
    "absent_and_reordered_features": (MIXED, ["b2", "a"], 2, 3, True),
    "all_bags_empty": (MIXED, ["a", "b1", "c"], 2, 0, True),
    "1000_tables": (MANY, SOME_MANY_KEYS, 2, 2, False),
}
SMALL_CASES = [c for c in CASES if c != "1000_tables"]


def _with_optimizer(tables: list[TableSpec], optimizer: str) -> list[TableSpec]:
    return [dataclasses.replace(t, optimizer=optimizer) for t in tables]


def _case(case: str, make, seed: int = 0, device="cpu", optimizer="rowwise_adagrad", keys=None):
    tables, case_keys, batch_size, max_len, weighted = CASES[case]
    keys = case_keys if keys is None else keys
    tables = _with_optimizer(tables, optimizer)
    rows = {f: t.num_rows for t in tables for f in t.features}
    gen = torch.Generator().manual_seed(seed)
    sf = make(rows, keys, batch_size, max_len=max_len, weighted=weighted, generator=gen, device=device)
    return tables, sf


def _step(m: PackedEmbeddingBag, sf: SparseFeatures, seed: int) -> torch.Tensor:
    out = m.forward_concat(sf)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out * g).sum().backward()
    return out.detach()


def _assert_same_state(got: PackedEmbeddingBag, want: PackedEmbeddingBag) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for k in want_sd:
        torch.testing.assert_close(got_sd[k], want_sd[k], msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_reference(backend, case, sparse_batch):
    tables, sf = _case(case, sparse_batch, seed=1)
    got = PackedEmbeddingBag(tables, backend=backend, seed=2).eval()
    want = PackedEmbeddingBag(tables, backend="reference", seed=2).eval()
    assert got.backend == backend
    torch.testing.assert_close(got.forward_concat(sf), want.forward_concat(sf))
    for g, w in zip(got.forward_packs(sf), want.forward_packs(sf)):
        torch.testing.assert_close(g, w)


@needs_triton
@pytest.mark.parametrize("sparse_grad", [False, True])
@pytest.mark.parametrize("case", SMALL_CASES)
def test_triton_autograd_gradients_match_reference(case, sparse_grad, sparse_batch):
    tables, sf = _case(case, sparse_batch, seed=3)
    got = PackedEmbeddingBag(tables, backend="triton", mode="autograd", sparse_grad=sparse_grad, seed=4)
    want = PackedEmbeddingBag(tables, backend="reference", mode="autograd", seed=4)
    torch.testing.assert_close(_step(got, sf, 5), _step(want, sf, 5))
    for (name, g), (_, w) in zip(got.named_parameters(), want.named_parameters()):
        if w.grad is None:  # a pack none of the batch's features use
            assert g.grad is None, name
            continue
        assert g.grad.is_sparse == sparse_grad, name
        torch.testing.assert_close(g.grad.to_dense(), w.grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("case", SMALL_CASES)
def test_fused_step_matches_reference(backend, optimizer, case, sparse_batch):
    if backend == "fbgemm" and optimizer == "adam":
        with pytest.raises(ConfigError, match="optimizer 'adam'"):
            PackedEmbeddingBag(_with_optimizer(MIXED, "adam"), backend="fbgemm")
        return
    tables, sf = _case(case, sparse_batch, seed=6, optimizer=optimizer)
    cfg = CFG if backend == "fbgemm" else CFG_DECAY  # fbgemm rejects weight decay
    got = PackedEmbeddingBag(tables, backend=backend, optim=cfg, seed=7)
    want = PackedEmbeddingBag(tables, backend="reference", optim=cfg, seed=7)
    assert list(got.parameters()) == []
    for step in range(2):
        torch.testing.assert_close(_step(got, sf, 8 + step), _step(want, sf, 8 + step))
        _assert_same_state(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_step_1000_tables(backend, sparse_batch):
    interpreted = backend == "triton" and not torch.cuda.is_available()
    tables, sf = _case(
        "1000_tables", sparse_batch, seed=9, keys=SOME_MANY_KEYS if interpreted else ALL_MANY_KEYS
    )
    got = PackedEmbeddingBag(tables, backend=backend, optim=CFG, seed=10)
    want = PackedEmbeddingBag(tables, backend="reference", optim=CFG, seed=10)
    assert len(got.plan.packs) == 1
    # fbgemm-gpu-cpu's backward opens a parallel region per table: on a busy 2-core machine
    # its spinning threads turn 5 ms into tens of seconds, so it runs single-threaded here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.testing.assert_close(_step(got, sf, 11), _step(want, sf, 11))
    finally:
        torch.set_num_threads(threads)
    _assert_same_state(got, want)


def _backends_available() -> list[str]:
    out = ["reference"]
    if torch.cuda.is_available() or triton_interpret_enabled():
        out.append("triton")
    if fbgemm_installed():
        out.append("fbgemm")
    return out


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_checkpoint_written_by_one_backend_loads_in_another(optimizer, sparse_batch):
    names = [b for b in _backends_available() if not (b == "fbgemm" and optimizer == "adam")]
    assert len(names) >= 2, f"only {names} available"
    tables, sf = _case("mixed_dims_shared_mean_weighted", sparse_batch, seed=12, optimizer=optimizer)
    for src in names:
        m = PackedEmbeddingBag(tables, backend=src, optim=CFG, seed=13)
        _step(m, sf, 14)
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        for dst in names:
            buf.seek(0)
            other = PackedEmbeddingBag(tables, backend=dst, optim=CFG, seed=99)
            other.load_state_dict(torch.load(buf, weights_only=True))
            _assert_same_state(other, m)
            # Training goes on identically from the loaded state (step counts included).
            twin = PackedEmbeddingBag(tables, backend="reference", optim=CFG, seed=98)
            twin.load_state_dict(m.state_dict())
            _step(other, sf, 15)
            _step(twin, sf, 15)
            _assert_same_state(other, twin)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_paths_check_ids(backend, sparse_batch):
    tables, sf = _case("absent_and_reordered_features", sparse_batch, seed=16)
    m = PackedEmbeddingBag(tables, backend=backend)
    values = sf.values.clone()
    values[-1] = 11  # the last id belongs to 'a' (11 rows)
    assert int(sf.offsets[sf.batch_size]) < values.numel()
    with pytest.raises(InvalidIdError, match=r"feature 'a': id 11 at batch row \d is out of range \[0, 11\)"):
        m(SparseFeatures(sf.keys, values, sf.offsets, sf.weights))


@needs_fbgemm
@pytest.mark.parametrize(
    "tables, mode, cfg, match",
    [
        ([TableSpec("t", 5, 6)], "fused", CFG, "dim 6 of table 't'"),
        ([TableSpec("t", 5, 4, optimizer="adam")], "fused", CFG, "optimizer 'adam' of table 't'"),
        ([TableSpec("t", 5, 4)], "autograd", CFG, "mode='autograd'"),
        ([TableSpec("t", 5, 4)], "fused", CFG_DECAY, "weight_decay=0.01"),
    ],
)
def test_fbgemm_rejects_unsupported_options(tables, mode, cfg, match):
    with pytest.raises(ConfigError, match=match):
        PackedEmbeddingBag(tables, backend="fbgemm", mode=mode, optim=cfg, device="cpu")
    assert (
        PackedEmbeddingBag(tables, backend="auto", mode=mode, optim=cfg, device="cpu").backend == "reference"
    )


@needs_fbgemm
def test_auto_picks_reference_on_cpu_and_fbgemm_only_when_asked():
    assert PackedEmbeddingBag(MIXED, backend="auto", device="cpu").backend == "reference"
    assert PackedEmbeddingBag(MIXED, backend="fbgemm", device="cpu").backend == "fbgemm"


# --------------------------------------------------------------------------- GPU


def _gpu_batch(tables: list[TableSpec], keys: list[str], batch_size: int, seed: int, make):
    rows = {f: t.num_rows for t in tables for f in t.features}
    gen = torch.Generator().manual_seed(seed)
    return make(rows, keys, batch_size, max_len=20, weighted=True, generator=gen, device="cuda")


GPU_TABLES = [
    TableSpec(f"g{i}", 1000 * (i + 1), 64 if i % 3 else 128, pooling="mean" if i % 4 == 0 else "sum")
    for i in range(26)
]
GPU_TABLES.append(TableSpec("shared", 50_000, 64, features=["s1", "s2"]))
GPU_KEYS = ["s2"] + [f"g{i}" for i in range(26)] + ["s1"]


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_gpu_triton_fused_step_matches_reference(optimizer, sparse_batch):
    tables = _with_optimizer(GPU_TABLES, optimizer)
    sf = _gpu_batch(tables, GPU_KEYS, 2048, 20, sparse_batch)
    got = PackedEmbeddingBag(tables, backend="triton", optim=CFG_DECAY, seed=21, device="cuda")
    want = PackedEmbeddingBag(tables, backend="reference", optim=CFG_DECAY, seed=21, device="cuda")
    atol = 1e-5
    if optimizer == "adam":
        # Adam's step maps a row gradient g to ~lr * g / (|g| + eps), slope up to lr / eps: the
        # float32 summation noise of g (~u * sqrt(n) * max |term|, n occurrences; a term is an
        # output gradient < 6 in N(0, 1) draws times a weight <= 1.5) grows by that, per row of
        # a bag (<= 20 rows).
        u, n = torch.finfo(torch.float32).eps / 2, int(torch.bincount(sf.values).max())
        atol += 20 * CFG_DECAY.lr / CFG_DECAY.eps * 4 * u * n**0.5 * 6 * 1.5
    for step in range(3):
        torch.testing.assert_close(
            _step(got, sf, 22 + step), _step(want, sf, 22 + step), rtol=1e-5, atol=atol
        )
    got_sd, want_sd = got.state_dict(), want.state_dict()
    for k in want_sd:
        torch.testing.assert_close(
            got_sd[k], want_sd[k], rtol=1e-4, atol=atol / 20, msg=lambda m, k=k: f"{k}: {m}"
        )


@pytest.mark.gpu
def test_gpu_triton_autograd_gradients_match_reference(sparse_batch):
    sf = _gpu_batch(GPU_TABLES, GPU_KEYS, 2048, 30, sparse_batch)
    got = PackedEmbeddingBag(GPU_TABLES, backend="triton", mode="autograd", seed=31, device="cuda")
    want = PackedEmbeddingBag(GPU_TABLES, backend="reference", mode="autograd", seed=31, device="cuda")
    torch.testing.assert_close(_step(got, sf, 32), _step(want, sf, 32), rtol=1e-5, atol=1e-5)
    for g, w in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(g.grad, w.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_learning_rate_reaches_the_fused_update(backend, sparse_batch):
    tables, sf = _case("mixed_dims_shared_mean_weighted", sparse_batch, seed=40, optimizer="sgd")
    got = PackedEmbeddingBag(tables, backend=backend, optim=CFG, seed=41)
    want = PackedEmbeddingBag(tables, backend="reference", optim=dataclasses.replace(CFG, lr=0.5), seed=41)
    got.set_learning_rate(0.5)
    _step(got, sf, 42)
    _step(want, sf, 42)
    _assert_same_state(got, want)


@pytest.mark.parametrize(
    ("backend", "mode"),
    [("reference", "fused"), ("reference", "autograd"), pytest.param("triton", "fused", marks=needs_triton)],
)
def test_packs_use_the_modules_current_tensors(backend, mode, sparse_batch):
    # to_empty() (like .to(device)) gives the module new tensors: loading, lookups and
    # fused updates must all reach those, not the ones the packs were built with.
    tables, sf = _case("mixed_dims_shared_mean_weighted", sparse_batch, seed=50, optimizer="adam")
    want = PackedEmbeddingBag(tables, backend="reference", mode=mode, optim=CFG, seed=51)
    got = PackedEmbeddingBag(tables, backend=backend, mode=mode, optim=CFG, seed=52)
    got.to_empty(device="cpu")
    got.load_state_dict(want.state_dict())
    torch.testing.assert_close(_step(got, sf, 53), _step(want, sf, 53))
    if mode == "autograd":
        for g, w in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(g.grad, w.grad)
    _assert_same_state(got, want)
