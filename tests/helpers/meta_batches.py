"""Small DLRMs and task batches for the meta-learning tests."""

from __future__ import annotations

import torch

from recaccel.models.arches import DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import PerTableEmbeddingBag
from recaccel.sparse import Batch, SparseFeatures, TaskBatch

NUM_FIELDS, DIM, NUM_DENSE, ROWS = 3, 4, 3, 12
KEYS = [f"f{i}" for i in range(NUM_FIELDS)]


def make_dlrm(embedding: str = "per_table", dtype: torch.dtype = torch.float64, seed: int = 1) -> DLRM:
    """A tiny DLRM whose embedding is trainable by autograd (per-table or packed)."""
    torch.manual_seed(seed)
    if embedding == "per_table":
        emb = PerTableEmbeddingBag(KEYS, [ROWS] * NUM_FIELDS, DIM)
    else:
        from recaccel.ops.embedding import PackedEmbeddingBag, TableSpec

        tables = [TableSpec(k, ROWS, DIM, pooling="sum") for k in KEYS]
        emb = PackedEmbeddingBag(tables, backend="reference", mode="autograd", seed=seed)
    inter = InteractionArch(NUM_FIELDS, DIM, backend="reference")
    model = DLRM(SparseArch(emb), DenseArch(NUM_DENSE, [6, DIM]), inter, OverArch(inter.output_dim, [5, 1]))
    return model.to(dtype)


def make_rows(n: int, gen: torch.Generator, loss: str, dtype: torch.dtype = torch.float64) -> Batch:
    lengths = torch.randint(0, 3, (NUM_FIELDS * n,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    if loss == "bce":
        labels = torch.randint(0, 2, (n,), generator=gen).to(dtype)
    else:
        labels = torch.randn(n, generator=gen, dtype=dtype) + 3.0
    dense = torch.randn(n, NUM_DENSE, generator=gen, dtype=dtype)
    return Batch(dense, SparseFeatures.from_lengths(KEYS, values, lengths), labels)


def make_task_batch(tasks: int, support: int, query: int, loss: str = "bce", seed: int = 0) -> TaskBatch:
    """Tasks with padded rows, one task without real support rows and one without query rows."""
    gen = torch.Generator().manual_seed(seed)
    s_mask = (torch.rand(tasks, support, generator=gen) > 0.3).double()
    q_mask = (torch.rand(tasks, query, generator=gen) > 0.3).double()
    s_mask[:, 0] = 1.0
    q_mask[:, 0] = 1.0
    if tasks >= 3:
        s_mask[1] = 0.0
        q_mask[2] = 0.0
    return TaskBatch(
        make_rows(tasks * support, gen, loss),
        make_rows(tasks * query, gen, loss),
        s_mask,
        q_mask,
        torch.arange(tasks),
    )
