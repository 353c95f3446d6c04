"""TorchRec embeddings behind recaccel's SparseArch: SparseFeatures -> [B, F, D].

:class:`TorchRecEmbedding` turns a batch's :class:`~recaccel.sparse.SparseFeatures`
into a KeyedJaggedTensor (``to_kjt()``, no copy), looks it up in a TorchRec
``EmbeddingBagCollection`` or its sharded form (``DistributedModelParallel``), and lays
the pooled ``KeyedTensor`` out as [B, F, D] in the batch's field order (a sharded
collection returns its features grouped by rank, not in table order). Features of
tables kept out of TorchRec (data-parallel tables in hybrid training) are pooled by a
replicated recaccel module and merged in.

The tables start from recaccel's own initial rows (:func:`table_weights` of the
packed or per-table embedding a model was built with), so a run with TorchRec and a
run with recaccel's embedding start from the same point.

TorchRec is imported only by the functions that need it.

Shapes: B batch, F fields, D embedding dim, R rows of a table.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from recaccel.errors import ConfigError, DataError
from recaccel.ops.embedding.specs import TableSpec
from recaccel.sparse import SparseFeatures


def embedding_tables(embedding: nn.Module) -> list[TableSpec]:
    """The tables of a recaccel embedding module (packed or per-table), in table order.

    Raises:
        ConfigError: the module is neither.
    """
    from recaccel.models.embedding import PerTableEmbeddingBag
    from recaccel.ops.embedding import PackedEmbeddingBag

    if isinstance(embedding, PackedEmbeddingBag):
        if embedding.dtype != "fp32":
            raise ConfigError(
                f"TorchRec tables (parallel.mode=hybrid) run model.embedding_dtype=fp32 only, got {embedding.dtype}"
            )
        return list(embedding.tables)
    if isinstance(embedding, PerTableEmbeddingBag):
        pooling = embedding.bags[0].mode if len(embedding.bags) else "sum"
        return [
            TableSpec(name, bag.num_embeddings, embedding.dim, [name], pooling)
            for name, bag in zip(embedding.features, embedding.bags)
        ]
    raise ConfigError(
        f"cannot move a {type(embedding).__name__} to TorchRec: expected recaccel's PackedEmbeddingBag "
        "or PerTableEmbeddingBag"
    )


def table_weights(embedding: nn.Module) -> dict[str, Tensor]:
    """Each table's current rows float32 [R, D] (CPU copies), by table name."""
    from recaccel.models.embedding import PerTableEmbeddingBag

    if isinstance(embedding, PerTableEmbeddingBag):
        return {n: bag.weight.detach().cpu().clone() for n, bag in zip(embedding.features, embedding.bags)}
    return {name: s["weight"].detach().cpu().clone() for name, s in embedding.table_states().items()}


def ebc_configs(tables: list[TableSpec]) -> list:
    """TorchRec ``EmbeddingBagConfig`` s of recaccel tables (same names, features, pooling)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
    return [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_rows,
            embedding_dim=t.dim,
            feature_names=list(t.features),
            pooling=pooling[t.pooling],
        )
        for t in tables
    ]


class EBCHolder(nn.Module):
    """The parent module ``DistributedModelParallel`` shards: it holds the collection as ``ebc``.

    Args:
        ebc: a TorchRec ``EmbeddingBagCollection``.
    """

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        """KeyedJaggedTensor -> pooled KeyedTensor (or its awaitable when sharded)."""
        return self.ebc(kjt)


class TorchRecEmbedding(nn.Module):
    """Pooled embeddings [B, F, D] of recaccel batches through a TorchRec lookup.

    Args:
        lookup: maps a KeyedJaggedTensor to a pooled ``KeyedTensor`` (or an awaitable of
            one): an ``EmbeddingBagCollection``, or ``DistributedModelParallel`` around an
            :class:`EBCHolder`.
        features: every feature this module serves.
        dim: D, the dim of every table.
        replicated: optional recaccel module (SparseFeatures -> [B, F_r, D]) pooling the
            features ``replicated_features`` outside TorchRec.
        replicated_features: the features ``replicated`` serves.
        register: False keeps ``lookup`` and ``replicated`` out of the module tree: their
            parameters and state are then invisible to ``parameters()``, ``state_dict()``
            and dense optimizers (a sharded collection updates its rows inside backward and
            is checkpointed shard by shard, see :mod:`recaccel.train.distributed.dist_checkpoint`);
            ``train()`` / ``eval()`` still reach them.

    Raises:
        ConfigError: ``replicated_features`` without ``replicated`` or not among ``features``.
    """

    def __init__(
        self,
        lookup: nn.Module,
        features: list[str],
        dim: int,
        *,
        replicated: nn.Module | None = None,
        replicated_features: list[str] | tuple[str, ...] = (),
        register: bool = True,
    ) -> None:
        super().__init__()
        if replicated_features and replicated is None:
            raise ConfigError("replicated_features given without a replicated module")
        unknown = set(replicated_features) - set(features)
        if unknown:
            raise ConfigError(f"replicated features {sorted(unknown)} are not among the features {features}")
        self.features = list(features)
        self.dim = int(dim)
        self.replicated_features = list(replicated_features)
        self.torchrec_features = [f for f in self.features if f not in set(self.replicated_features)]
        self.register = register
        if register:
            self.lookup = lookup
            self.replicated = replicated
        else:
            # Plain attributes: nn.Module.__setattr__ would register them.
            object.__setattr__(self, "lookup", lookup)
            object.__setattr__(self, "replicated", replicated)
        self._orders: dict[tuple, Tensor] = {}

    def train(self, mode: bool = True) -> TorchRecEmbedding:
        super().train(mode)
        if not self.register:
            for module in (self.lookup, self.replicated):
                if module is not None:
                    module.train(mode)
        return self

    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Looks up every field of a batch.

        The TorchRec lookup always gets its features in one order,
        :attr:`torchrec_features`, whatever the batch's order: a sharded collection fixes
        its feature permutation from the first batch it sees and applies it by position.

        Args:
            sparse: B rows of every field of :attr:`features`, in any order, without
                per-id weights.

        Returns:
            float32 [B, F, D] in ``sparse.keys`` order.

        Raises:
            DataError: per-id weights (not supported here), or the batch's fields are not
                :attr:`features`.
        """
        if sparse.weights is not None:
            raise DataError("TorchRec embeddings here take unweighted ids; the batch has per-id weights")
        sparse.check_keys(self.features)
        b = sparse.batch_size
        parts, names = [], []
        if self.torchrec_features:  # one gather puts them in that fixed order
            pooled = self.lookup(sparse.select(self.torchrec_features).to_kjt())
            keys = list(pooled.keys())
            parts.append(pooled.values().view(b, len(keys), self.dim))
            names += keys
        if self.replicated_features:
            parts.append(self.replicated(sparse.select(self.replicated_features)))
            names += self.replicated_features
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if names == list(sparse.keys):
            return out
        return out.index_select(1, self._order(tuple(names), tuple(sparse.keys), out.device))

    def _order(self, have: tuple[str, ...], want: tuple[str, ...], device: torch.device) -> Tensor:
        key = (have, want, device)
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = torch.tensor([have.index(k) for k in want], device=device)
        return order


def load_table_weights(state: Mapping[str, object], weights: Mapping[str, Tensor]) -> list[str]:
    """Copies full tables into a (sharded) collection's state, shard by shard.

    Args:
        state: a TorchRec module's ``state_dict()``: ``...embedding_bags.<table>.weight``
            entries, ``ShardedTensor`` s (each rank copies its local shards) or tensors.
        weights: full rows float32 [R, D] by table name.

    Returns:
        The tables copied.

    Raises:
        ConfigError: a table of ``weights`` is absent from ``state`` or shapes differ.
    """
    done = []
    by_table = {key.split(".")[-2]: value for key, value in state.items() if key.endswith(".weight")}
    with warnings.catch_warnings():
        # TorchRec's state dicts still hold ShardedTensors, which warn on every access.
        warnings.filterwarnings("ignore", message=".*ShardedTensor", category=FutureWarning)
        for name, full in weights.items():
            _copy_table(name, full, by_table.get(name), sorted(by_table))
            done.append(name)
    return done


def _copy_table(name: str, full: Tensor, target, tables: list[str]) -> None:
    if target is None:
        raise ConfigError(f"table {name!r} is not in the TorchRec module (tables: {tables})")
    if tuple(target.shape) != tuple(full.shape):
        raise ConfigError(
            f"table {name!r}: TorchRec has shape {tuple(target.shape)}, rows are {tuple(full.shape)}"
        )
    with torch.no_grad():
        if hasattr(target, "local_shards"):
            for shard in target.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
        else:
            target.copy_(full)
