"""What a packed embedding bag holds: table specs, sparse optimizer settings, errors.

Shapes: D embedding dim, R rows of a table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recaccel.config import EmbeddingPlacement, OptimConfig, Pooling, SparseOptimizer, choices
from recaccel.errors import ConfigError, DataError

POOLINGS = choices(Pooling)  # sum, mean
OPTIMIZERS = choices(SparseOptimizer)  # sgd, rowwise_adagrad, adam
PLACEMENTS = choices(EmbeddingPlacement)  # device, host

# Optimizer state of one table, by optimizer: (name, per-row?) where per-row state is
# [R] and per-element state is [R, D]. Names follow FBGEMM's (momentum1, momentum2).
OPTIMIZER_STATES: dict[str, tuple[tuple[str, bool], ...]] = {
    "sgd": (),
    "rowwise_adagrad": (("momentum1", True),),
    "adam": (("momentum1", False), ("momentum2", False)),
}


class InvalidIdError(DataError, IndexError):
    """A sparse id lies outside its feature's table (or the CSR offsets are malformed).

    It is both a :class:`~recaccel.errors.DataError` (the CLI reports it in one line) and
    an ``IndexError``; ``column`` names the feature.
    """


@dataclass
class TableSpec:
    """One embedding table and the features that look it up.

    Args:
        name: Table name; unique in a module; the prefix of its checkpoint keys.
        num_rows: R rows (ids are ``0 .. R-1``).
        dim: D columns.
        features: Names of the sparse features that look this table up (several
            features may share a table). Defaults to ``[name]``.
        pooling: ``"sum"`` or ``"mean"`` of the rows of a bag (see
            :class:`~recaccel.ops.embedding.PackedEmbeddingBag` for the exact rule).
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``, applied in the
            backward pass in fused mode.
        placement: ``"device"`` (rows and optimizer state on the module's device) or
            ``"host"`` (in host memory, pinned on CUDA, behind a device cache: see
            :mod:`recaccel.ops.embedding.cache`). Tables of different placements never
            share a pack.

    Raises:
        ConfigError: on an empty name, non-positive sizes or an unknown pooling,
            optimizer or placement.
    """

    name: str
    num_rows: int
    dim: int
    features: list[str] = field(default_factory=list)
    pooling: Pooling = "sum"
    optimizer: SparseOptimizer = "rowwise_adagrad"
    placement: EmbeddingPlacement = "device"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"table name must be a non-empty string, got {self.name!r}")
        if int(self.num_rows) < 1:
            raise ConfigError(f"table {self.name!r}: num_rows must be >= 1, got {self.num_rows}")
        if int(self.dim) < 1:
            raise ConfigError(f"table {self.name!r}: dim must be >= 1, got {self.dim}")
        self.num_rows, self.dim = int(self.num_rows), int(self.dim)
        self.features = list(self.features) if self.features else [self.name]
        if len(set(self.features)) != len(self.features):
            raise ConfigError(f"table {self.name!r}: duplicate feature names in {self.features}")
        for key, allowed in (("pooling", POOLINGS), ("optimizer", OPTIMIZERS), ("placement", PLACEMENTS)):
            value = getattr(self, key)
            if value not in allowed:
                raise ConfigError(f"table {self.name!r}: {key} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class SparseOptimConfig:
    """Hyper-parameters of the fused sparse optimizers (shared by all tables).

    Update rules on the rows a batch touches (``g`` = summed gradient of a row, over
    every occurrence of the row in the batch; untouched rows and their state are left
    as they are, i.e. lazy):

    - ``sgd``: ``w -= lr * (g + weight_decay * w)``.
    - ``rowwise_adagrad``: ``g' = g + weight_decay * w``; ``m += mean_d(g'^2)`` (one
      accumulator per row); ``w -= lr * g' / (sqrt(m) + eps)``.
    - ``adam``: ``m1 = beta1 m1 + (1-beta1) g``; ``m2 = beta2 m2 + (1-beta2) g^2``;
      ``w -= lr * (m1/(1-beta1^t) / (sqrt(m2/(1-beta2^t)) + eps) + weight_decay * w)``
      with ``t`` a per-pack step count (the number of backward passes that reached the
      pack), i.e. decoupled weight decay as in AdamW and FBGEMM's ADAM.

    These are FBGEMM's EXACT_SGD, EXACT_ROWWISE_ADAGRAD (L2 weight decay) and ADAM rules.

    Args:
        lr: Learning rate.
        eps: Added to the denominator (Adagrad, Adam).
        beta1: Adam first-moment decay.
        beta2: Adam second-moment decay.
        weight_decay: See the rules above; 0 disables it.
    """

    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    @classmethod
    def from_config(cls, cfg: OptimConfig) -> SparseOptimConfig:
        """The settings ``[optim]`` gives (``sparse_lr``, ``eps``; Adam's betas at their
        defaults): the one place a config becomes them, for recaccel's packed embeddings,
        TorchRec's FBGEMM kernels and the data-parallel tables alike."""
        return cls(lr=cfg.sparse_lr, eps=cfg.eps)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"sparse optimizer lr must be > 0, got {self.lr}")
        if not self.eps >= 0:
            raise ConfigError(f"sparse optimizer eps must be >= 0, got {self.eps}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"sparse optimizer {name} must be in [0, 1), got {getattr(self, name)}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"sparse optimizer weight_decay must be >= 0, got {self.weight_decay}")
