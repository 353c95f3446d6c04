"""Fused SGD and row-wise Adagrad against FBGEMM's own TBE (an outside reference).

The reference here is ``SplitTableBatchedEmbeddingBagsCodegen`` built directly from
fbgemm_gpu, one TBE over all tables of mixed dims, not recaccel's fbgemm backend. Both
start from the same rows, see the same batches (duplicate ids within and across bags,
a table shared by two features, per-id weights) and the same upstream gradients; the
pooled outputs, rows and optimizer state must agree after each of several steps.

Without CUDA the Triton backend runs under TRITON_INTERPRET=1 (conftest.py) on these
tiny shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.sparse import SparseFeatures

tbe_ops = pytest.importorskip(
    "fbgemm_gpu.split_table_batched_embeddings_ops_training",
    reason="fbgemm_gpu (fbgemm-gpu-cpu) is the outside reference for the fused optimizers",
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    EmbeddingLocation,
    PoolingMode,
)

pytestmark = pytest.mark.numeric


needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
LR, EPS, STEPS, BATCH = 0.2, 1e-3, 3, 4
# (table, rows, dim, features): small tables so ids repeat; dims 4 and 8 in one TBE.
TABLES = [("a", 5, 4, ["a"]), ("b", 3, 8, ["b1", "b2"]), ("c", 7, 4, ["c"]), ("d", 4, 8, ["d"])]
KEYS = ["a", "b1", "b2", "c", "d"]  # grouped by table, as FBGEMM's feature_table_map wants
FBGEMM_OPTIM = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}


def _batch(step: int, weighted: bool) -> SparseFeatures:
    """Field-major CSR with repeated ids in a bag, across bags and across the two b features."""
    gen = torch.Generator().manual_seed(100 + step)
    rows = {f: r for _, r, _, feats in TABLES for f in feats}
    lengths = torch.randint(1, 5, (len(KEYS) * BATCH,), generator=gen)
    lengths[BATCH - 1] = 0  # an empty bag
    values = []
    for f, key in enumerate(KEYS):
        n = int(lengths[f * BATCH : (f + 1) * BATCH].sum())
        ids = torch.randint(0, rows[key], (n,), generator=gen)
        ids[: min(n, 3)] = 1  # row 1 at least three times per feature
        values.append(ids)
    ids = torch.cat(values)
    weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    return SparseFeatures.from_lengths(KEYS, ids, lengths, weights)


def _fbgemm_tbe(optimizer: str, init: dict[str, torch.Tensor]):
    location, compute = EmbeddingLocation.HOST, tbe_ops.ComputeDevice.CPU
    tbe = tbe_ops.SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, location, compute) for _, rows, dim, _ in TABLES],
        feature_table_map=[i for i, (*_, feats) in enumerate(TABLES) for _ in feats],
        optimizer=FBGEMM_OPTIM[optimizer],
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for view, (name, *_) in zip(tbe.split_embedding_weights(), TABLES):
            view.copy_(init[name])
    return tbe


def _fbgemm_state(tbe, optimizer: str) -> dict[str, dict[str, torch.Tensor]]:
    weights = tbe.split_embedding_weights()
    out = {name: {"weight": weights[i].detach().clone()} for i, (name, *_) in enumerate(TABLES)}
    if optimizer == "rowwise_adagrad":
        for i, (name, rows, *_) in enumerate(TABLES):
            out[name]["momentum1"] = tbe.split_optimizer_states()[i][0].detach().clone().view(rows)
    return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_fused_steps_match_fbgemm_tbe(backend, optimizer, weighted):
    specs = [TableSpec(n, r, d, features=f, optimizer=optimizer) for n, r, d, f in TABLES]
    ours = PackedEmbeddingBag(
        specs, backend=backend, mode="fused", optim=SparseOptimConfig(lr=LR, eps=EPS), seed=5
    ).train()
    assert ours.backend == backend
    init = {name: ours.table_state(name)["weight"].detach().clone() for name, *_ in TABLES}
    assert all(w.abs().sum() > 0 for w in init.values())
    tbe = _fbgemm_tbe(optimizer, init)
    moved = False
    for step in range(STEPS):
        sf = _batch(step, weighted)
        a_ids = sf.values[: int(sf.offsets[BATCH])]
        assert torch.unique(a_ids).numel() < a_ids.numel()  # duplicate ids in feature "a"
        want = tbe(sf.values, sf.offsets, sf.weights)  # [B, sum D] in KEYS order
        got = ours.forward_concat(sf)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(step))
        (want * grad).sum().backward()
        (got * grad).sum().backward()
        ref_state = _fbgemm_state(tbe, optimizer)
        for name, *_ in TABLES:
            state = ours.table_state(name)
            assert set(state) == set(ref_state[name])
            moved |= bool((ref_state[name]["weight"] - init[name]).abs().max() > 1e-3)
            for key, value in ref_state[name].items():
                torch.testing.assert_close(
                    state[key],
                    value,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, s=step, n=name, k=key: f"step {s}, table {n}, {k}: {m}",
                )
    assert moved  # the steps changed rows, so the comparison covers the update
