"""DLRM composed of small arches.

``embed`` and ``head`` are split so meta-learning can look embeddings up once and
adapt the head functionally (see :mod:`recaccel.meta`).
"""

from __future__ import annotations

from torch import Tensor, nn

from recaccel.errors import ConfigError
from recaccel.models.arches import DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.sparse import Batch, SparseFeatures


class DLRM(nn.Module):
    """Deep Learning Recommendation Model: bottom MLP, embeddings, dot interaction, top MLP.

    Args:
        sparse_arch: SparseFeatures -> [B, F, D].
        dense_arch: [B, Dd] -> [B, D].
        interaction_arch: ([B, D], [B, F, D]) -> [B, K].
        over_arch: [B, K] -> logits [B].

    Fields meet the model by name: ``sparse_arch`` puts a batch's fields in the model's
    order (:attr:`features`) before the lookup.

    Raises:
        ConfigError: ``sparse_arch`` and ``interaction_arch`` disagree on the number of fields.
    """

    def __init__(
        self,
        sparse_arch: SparseArch,
        dense_arch: DenseArch,
        interaction_arch: InteractionArch,
        over_arch: OverArch,
    ) -> None:
        super().__init__()
        num_sparse = getattr(interaction_arch, "num_sparse", None)
        if num_sparse is not None and num_sparse != len(sparse_arch.features):
            raise ConfigError(
                f"the interaction takes {num_sparse} sparse fields but the SparseArch serves "
                f"{len(sparse_arch.features)}: {sparse_arch.features}"
            )
        self.sparse_arch = sparse_arch
        self.dense_arch = dense_arch
        self.interaction_arch = interaction_arch
        self.over_arch = over_arch

    @property
    def features(self) -> list[str]:
        """The F sparse field names, in the order of the pooled field axis."""
        return self.sparse_arch.features

    def embed(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, F, D], fields in :attr:`features` order whatever the batch's order.

        Raises:
            DataError: the batch's fields are not the model's.
        """
        return self.sparse_arch(sparse)

    def prepare_sparse(self, sparse: SparseFeatures) -> SparseFeatures:
        """``sparse`` ready for :meth:`embed`: in :attr:`features` order, and prepared by
        the embedding when it prepares its input ahead (see :meth:`SparseArch.prepare`)."""
        return self.sparse_arch.prepare(sparse)

    def head(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Logits [B] from dense features [B, Dd] and pooled embeddings [B, F, D]."""
        return self.over_arch(self.interaction_arch(self.dense_arch(dense), pooled))

    def forward(self, batch: Batch) -> Tensor:
        """Logits [B]."""
        return self.head(batch.dense, self.embed(batch.sparse))
