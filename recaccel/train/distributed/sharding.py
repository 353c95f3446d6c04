"""Sharding of embedding tables over ranks with TorchRec's planner and DistributedModelParallel.

``parallel.sharding`` sets every table's layout and ``parallel.table_sharding``
(``"name=kind"``) overrides it per table:

- ``table_wise``: each table lives whole on one rank; lookups travel by all-to-all.
- ``row_wise``: each rank holds a contiguous block of rows; ids are bucketized by
  row range, partial pools are summed by reduce-scatter.
- ``column_wise``: each rank holds some columns (TorchRec keeps column shards at least
  ``min_partition`` wide; a narrow table stays whole). Row-wise Adagrad then keeps one
  accumulator per row *per column shard*, a different (if close) optimizer from the
  unsharded one; SGD is unaffected.
- ``data_parallel``: the table is replicated; recaccel keeps it out of TorchRec (see
  :mod:`recaccel.train.distributed.hybrid`) and sums its gradients with the dense ones.
- ``auto``: TorchRec's planner picks among the sharded kinds.

The sparse optimizer runs fused into FBGEMM's backward (``optim.sparse`` /
``optim.sparse_lr`` / ``optim.eps``): EXACT_SGD and EXACT_ROWWISE_ADAGRAD everywhere,
ADAM on CUDA only (fbgemm-gpu-cpu has none). TorchRec offers row-wise sharding on CUDA
only; recaccel enables it on CPU too (it runs on gloo when every rank has the same local
batch size, which hybrid training guarantees).

TorchRec is imported only inside these functions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from recaccel.config import OptimConfig, ParallelConfig, ShardingKind, choices
from recaccel.errors import ConfigError
from recaccel.ops.embedding.specs import SparseOptimConfig, TableSpec

KINDS: tuple[ShardingKind, ...] = choices(ShardingKind)
# The kinds TorchRec shards (``data_parallel`` tables stay outside it): ``auto``'s choices.
_AUTO_KINDS = tuple(kind for kind in KINDS if kind != "data_parallel")


def table_kinds(cfg: ParallelConfig, tables: list[str]) -> dict[str, str]:
    """Each table's sharding kind (``auto`` or one of :data:`KINDS`).

    Raises:
        ConfigError: a malformed ``table_sharding`` entry, an unknown table or kind.
    """
    kinds = dict.fromkeys(tables, cfg.sharding)
    for entry in cfg.table_sharding:
        name, sep, kind = (part.strip() for part in entry.partition("="))
        if not sep or not name or not kind:
            raise ConfigError(f"parallel.table_sharding entry {entry!r} must look like name=kind")
        if name not in kinds:
            raise ConfigError(f"parallel.table_sharding entry {entry!r}: no table {name!r}; tables: {tables}")
        if kind not in ("auto", *KINDS):
            raise ConfigError(
                f"parallel.table_sharding entry {entry!r}: kind must be one of auto, {', '.join(KINDS)}"
            )
        kinds[name] = kind
    return kinds


def fused_params(optim: OptimConfig, device: torch.device) -> dict:
    """FBGEMM's fused optimizer settings for ``optim.sparse``.

    Raises:
        ConfigError: Adam on CPU (fbgemm-gpu-cpu has no Adam).
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if optim.sparse == "adam" and device.type != "cuda":
        raise ConfigError(
            "optim.sparse=adam: TorchRec's FBGEMM kernels have no Adam on CPU; use sgd or rowwise_adagrad"
        )
    kind = {
        "sgd": EmbOptimType.EXACT_SGD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adam": EmbOptimType.ADAM,
    }[optim.sparse]
    rule = SparseOptimConfig.from_config(optim)
    params = {"optimizer": kind, "learning_rate": rule.lr, "eps": rule.eps}
    if optim.sparse == "adam":
        params.update(beta1=rule.beta1, beta2=rule.beta2)
    return params


def make_sharder(fused: Mapping):
    """An ``EmbeddingBagCollectionSharder`` with the fused optimizer that also offers
    row-wise sharding on CPU."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class _Sharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            return types + ["row_wise"] if "row_wise" not in types else types

    return _Sharder(fused_params=dict(fused))


def _constraints(
    tables: list[TableSpec], kinds: Mapping[str, str], world_size: int, device: torch.device
) -> dict:
    from torchrec.distributed.planner.types import ParameterConstraints

    kernels = None if device.type == "cuda" else ["fused"]
    out = {}
    for t in tables:
        kind = kinds[t.name]
        # Asked for column-wise explicitly: split across the ranks (TorchRec's default
        # minimum shard width, 128 columns, would leave narrow tables whole).
        width = max(4, t.dim // world_size // 4 * 4) if kind == "column_wise" else None
        out[t.name] = ParameterConstraints(
            sharding_types=list(_AUTO_KINDS if kind == "auto" else (kind,)),
            compute_kernels=kernels,
            min_partition=width,
        )
    return out


def _topology(world_size: int, local_world_size: int, device: torch.device):
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

    return TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_world_size),
        kernel_config=KernelConfig(compute_device=device.type),
    )


def shard_tables(
    tables: list[TableSpec],
    kinds: Mapping[str, str],
    optim: OptimConfig,
    device: torch.device,
    local_world_size: int,
    group: dist.ProcessGroup | None = None,
):
    """Builds a TorchRec collection of ``tables`` and shards it over the process group.

    Args:
        tables: the tables (none of them ``data_parallel``).
        kinds: each table's kind (``auto`` or a sharded kind).
        optim: the sparse optimizer settings.
        device: this rank's device.
        local_world_size: ranks per host (the planner's intra-host domain).
        group: the process group (default: the world).

    Returns:
        ``(dmp, plan)``: ``DistributedModelParallel`` around an
        :class:`~recaccel.models.torchrec_sparse.EBCHolder` (its rows freshly
        initialised; copy the real ones in with
        :func:`~recaccel.models.torchrec_sparse.load_table_weights`), and the plan.

    Raises:
        ConfigError: unsupported dims, optimizer or kinds.
    """
    from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recaccel.models.torchrec_sparse import EBCHolder, ebc_configs

    bad = [t.name for t in tables if t.dim % 4]
    if bad:
        raise ConfigError(
            f"TorchRec's FBGEMM kernels need embedding dims that are multiples of 4; tables {bad} are not"
        )
    if any(kinds[t.name] == "data_parallel" for t in tables):
        raise ConfigError("data_parallel tables are replicated outside TorchRec, not sharded")

    class _NoDataParallel(DataParallelWrapper):
        # The holder has no dense parameters; recaccel syncs dense gradients itself.
        def wrap(self, dmp, env, device) -> None:
            pass

    from torchrec.distributed.comm_ops import set_gradient_division

    # TorchRec divides pooled-embedding gradients by the world size (DDP's mean over
    # ranks); recaccel's ranks backprop their share of the global mean loss instead.
    set_gradient_division(False)
    group = group or dist.GroupMember.WORLD
    sharder = make_sharder(fused_params(optim, device))
    holder = EBCHolder(EmbeddingBagCollection(tables=ebc_configs(tables), device=torch.device("meta")))
    world_size = dist.get_world_size(group)
    planner = EmbeddingShardingPlanner(
        topology=_topology(world_size, local_world_size, device),
        constraints=_constraints(tables, kinds, world_size, device),
        # The holder has no dense tensors; keep 15% of device memory for the dense side.
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    plan = planner.collective_plan(holder, [sharder], group)
    dmp = DistributedModelParallel(
        holder,
        env=ShardingEnv.from_process_group(group),
        device=device,
        plan=plan,
        sharders=[sharder],
        data_parallel_wrapper=_NoDataParallel(),
    )
    return dmp, plan


def plan_rows(plan) -> list[dict]:
    """One row per table of a TorchRec plan: kind, kernel, ranks and shard sizes."""
    rows = []
    for module_plan in plan.plan.values():
        for table, p in module_plan.items():
            shards = p.sharding_spec.shards if p.sharding_spec is not None else []
            rows.append(
                {
                    "table": table,
                    "sharding": p.sharding_type,
                    "kernel": p.compute_kernel,
                    "ranks": list(p.ranks or []),
                    "shards": [list(s.shard_sizes) for s in shards],
                }
            )
    return rows
