"""A model named by ``model.class_path`` in tests/train/model/test_deferred_bounds.py: its first
field's table is shorter than the data's cardinality, so the reader's valid ids reach the
packed embedding out of range (what a model built for other data would meet)."""

from __future__ import annotations

import torch
from torch import nn

from recaccel.models import SparseArch
from recaccel.ops.embedding import PackedEmbeddingBag, TableSpec


class ShortTable(nn.Module):
    """Pooled embeddings (Triton backend) flattened beside the dense features, one linear
    layer; the first field's table has ``rows`` rows (0: the field's cardinality),
    ``bounds_check`` as given."""

    def __init__(self, cfg, schema, device, rows: int = 10, bounds_check: object = "deferred"):
        super().__init__()
        dim = cfg.model.embedding_dim
        tables = [
            TableSpec(f.name, rows if i == 0 and rows else f.cardinality, dim)
            for i, f in enumerate(schema.sparse)
        ]
        embedding = PackedEmbeddingBag(
            tables, backend="triton", bounds_check=bounds_check, seed=0, device=device
        )
        self.sparse_arch = SparseArch(embedding, [f.name for f in schema.sparse])
        self.linear = nn.Linear(schema.num_dense + schema.num_sparse * dim, 1)

    def prepare_sparse(self, sparse):
        return self.sparse_arch.prepare(sparse)

    def embed(self, sparse):
        return self.sparse_arch(sparse)  # [B, F, D]

    def head(self, dense, pooled):
        return self.linear(torch.cat([dense, pooled.flatten(1)], dim=1)).squeeze(1)  # logits [B]
