"""What hybrid mode needs of the model and of the step, refused in one line otherwise:
TorchRec installed, exactly one SparseArch whose tables share one embedding dim, and a
step without micro-batches, CUDA graphs or compilation (single-process features)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from recaccel.config import TrainConfig
from recaccel.errors import ConfigError


@dataclass
class SparseArchTables:
    """The model's SparseArch and what sharding needs of it.

    Attributes:
        prefix: the embedding's state-dict prefix (``"sparse_arch.embedding."``).
        arch: the SparseArch module.
        tables: its TableSpecs.
        dim: their one embedding dim.
        weights: each table's initial rows [R, D].
    """

    prefix: str
    arch: nn.Module
    tables: list[Any]
    dim: int
    weights: dict[str, Tensor]


def sparse_arch_tables(module: nn.Module) -> SparseArchTables:
    """The one SparseArch of ``module`` and its tables.

    Raises:
        ConfigError: TorchRec is missing, no (or several) SparseArch, or tables of several dims.
    """
    try:
        import torchrec  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"parallel.mode=hybrid needs TorchRec and FBGEMM (pip install 'recaccel[torchrec]'): {e}"
        ) from None
    from recaccel.models.arches import SparseArch
    from recaccel.models.torchrec_sparse import embedding_tables, table_weights

    arches = [(name, m) for name, m in module.named_modules() if isinstance(m, SparseArch)]
    if len(arches) != 1:
        raise ConfigError(f"hybrid mode needs exactly one SparseArch in the model, found {len(arches)}")
    arch_name, arch = arches[0]
    tables = embedding_tables(arch.embedding)
    dims = {t.dim for t in tables}
    if len(dims) != 1:
        raise ConfigError(f"hybrid mode needs one embedding dim for all tables, got {sorted(dims)}")
    prefix = f"{arch_name}.embedding." if arch_name else "embedding."
    return SparseArchTables(prefix, arch, tables, dims.pop(), table_weights(arch.embedding))


def check_hybrid_step(train: TrainConfig) -> None:
    """Refuses step features that run only in one process.

    Raises:
        ConfigError: micro-batches, CUDA graphs or ``train.compile``.
    """
    if train.micro_batches > 1:
        raise ConfigError(
            f"train.micro_batches={train.micro_batches} runs parallel.mode=single; use train.micro_batches=1"
        )
    if train.cuda_graphs or train.compile:
        key = "train.cuda_graphs" if train.cuda_graphs else "train.compile"
        raise ConfigError(f"{key}=true runs parallel.mode=single; set it to false in hybrid mode")
