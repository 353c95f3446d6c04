"""Data-parallel (``data_parallel``) tables of hybrid runs: a replicated recaccel embedding
trained by a torch optimizer running the sparse rule on dense gradients."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recaccel.config import OptimConfig, SparseOptimizer
from recaccel.errors import ConfigError
from recaccel.ops.embedding.specs import SparseOptimConfig

# The sparse rules a replicated table can run (as torch optimizers on dense gradients).
_REPLICATED_OPTIMIZERS: tuple[SparseOptimizer, ...] = ("sgd", "rowwise_adagrad")


def replicated_tables(
    tables: list, optim: OptimConfig, device: torch.device, weights: dict[str, Tensor] | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Data-parallel tables: a replicated recaccel embedding (autograd mode) and the torch
    optimizer running their sparse rule; also what a checkpoint's ``replicated_optim`` is
    checked against.

    Args:
        tables: the data-parallel tables' TableSpecs.
        optim: ``[optim]``.
        device: where the rows live.
        weights: each table's rows [R, D] to start from (None: the module's own init).

    Raises:
        ConfigError: ``optim.sparse`` has no torch-optimizer form.
    """
    from recaccel.ops.embedding import PackedEmbeddingBag

    if optim.sparse not in _REPLICATED_OPTIMIZERS:
        raise ConfigError(
            f"data_parallel tables support optim.sparse = sgd or rowwise_adagrad, got {optim.sparse!r}"
        )
    module = PackedEmbeddingBag(tables, backend="reference", mode="autograd", device=device)
    if weights is not None:
        with torch.no_grad():
            for t in tables:
                module.table_state(t.name)["weight"].copy_(weights[t.name])
    params = list(module.parameters())
    rule = SparseOptimConfig.from_config(optim)
    if optim.sparse == "sgd":
        return module, torch.optim.SGD(params, lr=rule.lr)
    from torchrec.optim import RowWiseAdagrad  # the FBGEMM rule on dense gradients

    return module, RowWiseAdagrad(params, lr=rule.lr, eps=rule.eps)
