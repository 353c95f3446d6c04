"""Per-table embedding bags: one ``nn.EmbeddingBag`` per table, looked up in a loop.

This is what most users write by hand. recaccel keeps it as the baseline of the
embedding benchmark and as ``model.embedding_backend = "per_table"``; the packed
operator in :mod:`recaccel.ops.embedding` computes the same thing in a few launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from recaccel.config import (
    EmbeddingBackend,
    EmbeddingDtype,
    EmbeddingPlacement,
    Pooling,
    SparseOptimizer,
    choices,
)
from recaccel.errors import ConfigError
from recaccel.sparse import SparseFeatures

if TYPE_CHECKING:  # only read by attribute: models do not depend on io at run time
    from recaccel.io.format.schema import SparseField

EMBEDDING_BACKENDS = choices(EmbeddingBackend)


class PerTableEmbeddingBag(nn.Module):
    """One embedding table per feature, pooled per bag.

    Args:
        features: F feature names (the model's field order); a batch may list them in
            any order, and the output follows the batch's.
        num_rows: rows of each feature's table.
        dim: embedding dim D (all tables).
        pooling: ``"sum"`` or ``"mean"``.
        sparse: sparse row gradients (for SGD/SparseAdam/Adagrad) instead of dense [R, D] ones.
    """

    def __init__(
        self,
        features: list[str],
        num_rows: list[int],
        dim: int,
        pooling: Pooling = "sum",
        sparse: bool = False,
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
        """Looks up every feature, by name.

        Args:
            sparse: B rows of every field of :attr:`features`, in any order.

        Returns:
            [B, F, D] pooled embeddings in ``sparse.keys`` order.

        Raises:
            DataError: the batch's fields are not :attr:`features`.
        """
        sparse.check_keys(self.features)
        bags = dict(zip(self.features, self.bags))
        pooled = []
        for name in sparse.keys:
            bag = bags[name]
            values, offsets, weights = sparse.field(name)
            bad = (values < 0) | (values >= bag.num_embeddings)
            if bool(bad.any()):
                raise IndexError(
                    f"feature {name!r}: id {int(values[bad][0])} out of range [0, {bag.num_embeddings})"
                )
            pooled.append(bag(values, offsets[:-1], per_sample_weights=weights))
        return torch.stack(pooled, dim=1)


def field_embedding(
    fields: list[SparseField],
    dim: int,
    *,
    backend: EmbeddingBackend,
    pooling: Pooling = "sum",
    mode: str = "fused",
    optimizer: SparseOptimizer = "sgd",
    optim=None,
    device: torch.device | str | None = None,
    seed: int | None = None,
    dtype: EmbeddingDtype = "fp32",
    placement: dict[str, EmbeddingPlacement] | None = None,
    cache=None,
) -> nn.Module:
    """One table per field, looked up per table (``per_table``) or packed.

    Args:
        fields: the F sparse fields (each with ``name`` and ``cardinality``), in the
            order of the output's field axis.
        dim: D.
        backend: ``per_table`` or a :class:`~recaccel.ops.embedding.PackedEmbeddingBag`
            backend (``auto``, ``reference``, ``triton``, ``fbgemm``).
        pooling: ``sum`` or ``mean`` of a multi-hot bag.
        mode: packed only: ``fused`` (sparse optimizer in backward) or ``autograd``.
        optimizer: packed only: the fused sparse optimizer's name.
        optim: packed only: a :class:`~recaccel.ops.embedding.SparseOptimConfig`.
        device: where the tables live.
        seed: packed only: seed of the initial rows.
        dtype: the rows' dtype: ``fp32``, or ``bf16`` / ``fp16`` (packed, fused mode).
        placement: packed only: ``host`` for the fields whose tables live in host memory
            behind a device cache (default: every table on ``device``).
        cache: packed only: the device cache of the host tables, a
            :class:`~recaccel.ops.embedding.cache.CacheOptions`.

    Returns:
        A module mapping SparseFeatures to [B, F, D] (float32 whatever ``dtype``). A
        packed one checks ids with ``bounds_check="auto"``: inside the Triton lookup
        kernels, the error raised at the next log step, checkpoint or evaluation;
        eagerly, before the lookup, on the other backends.

    Raises:
        ConfigError: unknown backend; a 16-bit dtype with ``per_table`` or on a backend
            that cannot update it.
    """
    if backend not in EMBEDDING_BACKENDS:
        raise ConfigError(f"embedding backend must be one of {EMBEDDING_BACKENDS}, got {backend!r}")
    if backend == "per_table" and dtype != "fp32":
        raise ConfigError(
            f"model.embedding_backend=per_table does not support model.embedding_dtype={dtype} (its tables are "
            "dense-optimizer parameters, whose state would be 16-bit too); use a packed backend"
        )
    placement = placement or {}
    if backend == "per_table" and "host" in placement.values():
        raise ConfigError(
            "model.embedding_backend=per_table keeps every table on the device; host placement needs a "
            "packed backend (auto, reference or triton)"
        )
    if backend == "per_table":
        names, rows = [f.name for f in fields], [f.cardinality for f in fields]
        return PerTableEmbeddingBag(names, rows, dim, pooling).to(device)
    from recaccel.ops.embedding import EmbeddingOptions, PackedEmbeddingBag, TableSpec

    tables = [
        TableSpec(
            f.name,
            f.cardinality,
            dim,
            pooling=pooling,
            optimizer=optimizer,
            placement=placement.get(f.name, "device"),
        )
        for f in fields
    ]
    # Deferred bounds check on Triton: counted in the lookup kernels, read at log steps and
    # checkpoints (no host sync per batch); the other backends and host tables check eagerly.
    options = EmbeddingOptions(
        backend=backend, mode=mode, optim=optim, dtype=dtype, cache=cache, bounds_check="auto"
    )
    return PackedEmbeddingBag(tables, options, device=device, seed=seed)
