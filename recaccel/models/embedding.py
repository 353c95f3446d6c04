"""Per-table embedding bags: one ``nn.EmbeddingBag`` per table, looked up in a loop.

This is what most users write by hand. recaccel keeps it as the baseline of the
embedding benchmark and as ``model.embedding_backend = "per_table"``; the packed
operator in :mod:`recaccel.ops.embedding` computes the same thing in a few launches.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recaccel.io.batch import SparseFeatures


class PerTableEmbeddingBag(nn.Module):
    """One embedding table per feature, pooled per bag.

    Args:
        features: F feature names, in the order of the output's field axis.
        num_rows: rows of each feature's table.
        dim: embedding dim D (all tables).
        pooling: ``"sum"`` or ``"mean"``.
        sparse: sparse row gradients (for SGD/SparseAdam/Adagrad) instead of dense [R, D] ones.
    """

    def __init__(
        self, features: list[str], num_rows: list[int], dim: int, pooling: str = "sum", sparse: bool = False
    ) -> None:
        super().__init__()
        if len(features) != len(num_rows):
            raise ValueError(f"{len(features)} features but {len(num_rows)} table sizes")
        self.features = list(features)
        self.dim = dim
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode=pooling, sparse=sparse) for n in num_rows)
        for bag, n in zip(self.bags, num_rows):
            bound = n**-0.5
            nn.init.uniform_(bag.weight, -bound, bound)

    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Looks up every feature.

        Args:
            sparse: F fields of B rows; ``sparse.keys`` must equal ``self.features``.

        Returns:
            [B, F, D] pooled embeddings.
        """
        if sparse.keys != self.features:
            raise ValueError(f"sparse keys {sparse.keys} != embedding features {self.features}")
        pooled = []
        for name, bag in zip(self.features, self.bags):
            values, offsets, weights = sparse.field(name)
            bad = (values < 0) | (values >= bag.num_embeddings)
            if bool(bad.any()):
                raise IndexError(
                    f"feature {name!r}: id {int(values[bad][0])} out of range [0, {bag.num_embeddings})"
                )
            pooled.append(bag(values, offsets[:-1], per_sample_weights=weights))
        return torch.stack(pooled, dim=1)
