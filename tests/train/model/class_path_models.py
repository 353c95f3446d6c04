"""Models named by ``model.class_path`` in tests/train/model/test_class_path.py: docs/own_model.md's
example model, and ones that break the contract in each way the CLI refuses."""

from __future__ import annotations

import torch
from torch import nn

from recaccel.models import SparseArch, build_embedding


class ConcatMLP(nn.Module):
    """Dense features next to the flattened pooled embeddings, then one MLP of ``hidden`` units."""

    def __init__(self, cfg, schema, device, hidden: int = 32):
        super().__init__()
        self.sparse_arch = SparseArch(build_embedding(cfg.model, cfg.optim, schema, device))
        width = schema.num_dense + schema.num_sparse * cfg.model.embedding_dim
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def prepare_sparse(self, sparse):
        return self.sparse_arch.prepare(sparse)

    def embed(self, sparse):
        return self.sparse_arch(sparse)  # [B, F, D]

    def head(self, dense, pooled):
        return self.mlp(torch.cat([dense, pooled.flatten(1)], dim=1)).squeeze(1)  # logits [B]


class NoHead(nn.Module):
    """Lacks ``head``: refused by the contract check."""

    def __init__(self, cfg, schema, device):
        super().__init__()

    def prepare_sparse(self, sparse):
        return sparse

    def embed(self, sparse):
        return sparse


def not_a_module(cfg, schema, device):
    """A builder that returns something other than a module."""
    return "model"


NOT_CALLABLE = 3
