"""MeLU-style rating model (Lee et al., "MeLU: Meta-Learned User Preference Estimator
for Cold-Start Recommendation", KDD 2019).

Item attributes (e.g. rate, genre, director, actors) and user attributes (gender, age,
occupation, zip code) are embedded, multi-hot ones pooled (mean, as MeLU divides the
summed embeddings by the number of ids; for a single id mean equals the embedding),
concatenated item-first, and fed to an MLP (two hidden layers of 64 by default) with a
linear rating output. MeLU adapts only the MLP per user; here that is
``MetaConfig.adapt = "top_mlp"``.

The model is a :class:`~recaccel.models.dlrm.DLRM` with other arches, so it has the
same ``embed(sparse)`` / ``head(dense, pooled)`` interface that
:class:`recaccel.meta.MetaLearner` adapts.

Shapes: B batch, F = item + user fields, D embedding dim, Dd dense features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from recaccel.config import EmbeddingBackend, Pooling, choices
from recaccel.errors import ConfigError
from recaccel.models.arches import DenseArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import field_embedding

if TYPE_CHECKING:  # only read by attribute: models do not depend on io at run time
    from recaccel.io.format.schema import SparseField


@dataclass
class MeLUConfig:
    """Shape of a MeLU model.

    Args:
        item_fields: item attribute fields (SparseFeatures keys come item fields first).
        user_fields: user attribute fields.
        embedding_dim: D (MeLU: 32).
        hidden: hidden layer sizes of the rating MLP (MeLU: 64, 64).
        num_dense: Dd extra dense features (MeLU has none); they join the concatenation.
        dense_mlp: optional layer sizes of a bottom MLP for the dense features; empty
            passes them through unchanged.
        pooling: ``"mean"`` (MeLU) or ``"sum"`` of a multi-hot field's embeddings.
    """

    item_fields: list[SparseField]
    user_fields: list[SparseField]
    embedding_dim: int = 32
    hidden: list[int] = field(default_factory=lambda: [64, 64])
    num_dense: int = 0
    dense_mlp: list[int] = field(default_factory=list)
    pooling: Pooling = "mean"

    def __post_init__(self) -> None:
        if not self.item_fields and not self.user_fields:
            raise ConfigError("MeLU needs at least one item or user field")
        names = self.feature_names
        if len(set(names)) != len(names):
            raise ConfigError(f"MeLU field names repeat: {names}")
        if self.embedding_dim < 1 or any(h < 1 for h in self.hidden) or any(h < 1 for h in self.dense_mlp):
            raise ConfigError(
                f"MeLU sizes must be positive: embedding_dim={self.embedding_dim}, hidden={self.hidden}, "
                f"dense_mlp={self.dense_mlp}"
            )
        if self.num_dense < 0 or (self.dense_mlp and self.num_dense == 0):
            raise ConfigError(f"MeLU dense_mlp={self.dense_mlp} needs num_dense > 0, got {self.num_dense}")
        if self.pooling not in choices(Pooling):
            raise ConfigError(f"MeLU pooling must be 'sum' or 'mean', got {self.pooling!r}")

    @property
    def fields(self) -> list[SparseField]:
        """Item fields, then user fields: the order of the pooled field axis."""
        return list(self.item_fields) + list(self.user_fields)

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.fields]


class ConcatInteraction(nn.Module):
    """MeLU's "interaction": the pooled embeddings flattened, then the dense vector.

    Args:
        num_sparse: F.
        dim: D.
        dense_dim: width of the dense vector (0 without dense features).
    """

    def __init__(self, num_sparse: int, dim: int, dense_dim: int = 0) -> None:
        super().__init__()
        self.num_sparse, self.dim, self.dense_dim = num_sparse, dim, dense_dim

    @property
    def output_dim(self) -> int:
        return self.num_sparse * self.dim + self.dense_dim

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Maps dense [B, Dh] and pooled [B, F, D] to [B, F*D + Dh]."""
        return torch.cat([pooled.flatten(-2), dense], dim=-1)


class DensePassThrough(nn.Module):
    """A dense arch without parameters: the dense features as they are."""

    def forward(self, dense: Tensor) -> Tensor:
        return dense


def melu_embedding(
    cfg: MeLUConfig,
    *,
    backend: EmbeddingBackend = "per_table",
    mode: str = "autograd",
    optim=None,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> nn.Module:
    """The attribute embeddings of ``cfg``: per-table bags, or recaccel's packed embedding.

    Args:
        cfg: the model shape.
        backend: ``"per_table"`` (one ``nn.EmbeddingBag`` per field) or a
            :class:`~recaccel.ops.embedding.PackedEmbeddingBag` backend.
        mode: packed only: ``"fused"`` (sparse optimizer in backward) or ``"autograd"``.
        optim: packed only: a :class:`~recaccel.ops.embedding.SparseOptimConfig`.
        device: where the tables live.
        seed: packed only: seed of the initial rows.

    Raises:
        ConfigError: unknown backend.
    """
    return field_embedding(
        cfg.fields,
        cfg.embedding_dim,
        backend=backend,
        pooling=cfg.pooling,
        mode=mode,
        optim=optim,
        device=device,
        seed=seed,
    )


class MeLU(DLRM):
    """MeLU rating model: attribute embeddings, concatenation, MLP, linear rating.

    Args:
        cfg: the model shape.
        embedding: SparseFeatures -> [B, F, D] in ``cfg.feature_names`` order; by
            default :func:`melu_embedding` with per-table bags.
    """

    def __init__(self, cfg: MeLUConfig, embedding: nn.Module | None = None) -> None:
        dense_arch: nn.Module = (
            DenseArch(cfg.num_dense, cfg.dense_mlp) if cfg.dense_mlp else DensePassThrough()
        )
        dense_dim = cfg.dense_mlp[-1] if cfg.dense_mlp else cfg.num_dense
        interaction = ConcatInteraction(len(cfg.fields), cfg.embedding_dim, dense_dim)
        super().__init__(
            sparse_arch=SparseArch(
                embedding if embedding is not None else melu_embedding(cfg), features=cfg.feature_names
            ),
            dense_arch=dense_arch,
            interaction_arch=interaction,
            over_arch=OverArch(interaction.output_dim, [*cfg.hidden, 1]),
        )
        self.cfg = cfg
