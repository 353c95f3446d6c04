"""Multi-process training: TorchRec-sharded embeddings, data-parallel dense layers.

:class:`HybridParallel` is the process layout (the Trainer's ``Parallelism``: sharding,
batch slicing, gradient sync); beside it the process group (``group``), each rank's data
(``hybrid_data``), the per-step agreement (``lockstep``), the straggler policies
(``straggler/``: ``off``, ``rebalance``, ``backup``), the monitor (``monitor``) and fault
injection (``faults``), both step observers, the dense gradient allreduce (``dense_sync``),
table sharding (``sharding``, ``replicated``, ``lookup``), TorchRec's pipelines
(``hybrid_pipeline``), sharded checkpoints (``dist_checkpoint``) and the launcher (``launch``).

Names resolve on first use: importing this package needs neither TorchRec nor a
process group (TorchRec is optional; it is imported when tables are sharded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recaccel.lazy import lazy_exports

if TYPE_CHECKING:
    from recaccel.train.distributed.collectives import CollectiveError
    from recaccel.train.distributed.dense_sync import DenseGradSync
    from recaccel.train.distributed.dist_checkpoint import consolidated_state_dict, load_sharded, save_sharded
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.distributed.hybrid_data import GlobalSlices
    from recaccel.train.distributed.launch import check_launch, relaunch, under_torchrun
    from recaccel.train.distributed.sharding import plan_rows, shard_tables, table_kinds

# Each public name and the submodule defining it (imported on first use).
_EXPORTS = {
    "HybridParallel": "hybrid",
    "CollectiveError": "collectives",
    "GlobalSlices": "hybrid_data",
    "DenseGradSync": "dense_sync",
    "shard_tables": "sharding",
    "table_kinds": "sharding",
    "plan_rows": "sharding",
    "save_sharded": "dist_checkpoint",
    "load_sharded": "dist_checkpoint",
    "consolidated_state_dict": "dist_checkpoint",
    "check_launch": "launch",
    "relaunch": "launch",
    "under_torchrun": "launch",
}

__all__ = [
    "CollectiveError",
    "DenseGradSync",
    "GlobalSlices",
    "HybridParallel",
    "check_launch",
    "consolidated_state_dict",
    "load_sharded",
    "plan_rows",
    "relaunch",
    "save_sharded",
    "shard_tables",
    "table_kinds",
    "under_torchrun",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
