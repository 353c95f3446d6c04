"""FBGEMM backend: one table-batched embedding (TBE) per pack, fused mode only.

FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` looks up all tables of a pack in one
op and applies the optimizer inside its backward. This module converts recaccel's
field-major CSR to the TBE's input: one TBE "feature" per feature the pack's tables
declare, grouped by table (``feature_table_map`` non-decreasing; fbgemm-gpu-cpu 1.8.0
fails in row-wise Adagrad's backward when a table's features are not adjacent), with
empty bags for features absent from the batch; ``offsets`` has length ``T*B+1`` in
feature-major order, exactly recaccel's layout. Mean pooling and per-id weights both go
through ``per_sample_weights`` with ``PoolingMode.SUM`` (weight times ``1/L``), so a pack
may mix sum and mean tables and the semantics match the reference exactly.

What fbgemm-gpu-cpu 1.8.0 does on CPU (tried): EXACT_SGD and EXACT_ROWWISE_ADAGRAD train,
with per-sample weights, matching the reference; weight decay is accepted but silently
ignored (L2 and decoupled modes alike); ADAM and PARTIAL_ROWWISE_ADAM are refused ("not
supported in CPU mode"); dims must be multiples of 4. This backend therefore rejects Adam
and weight decay (use ``backend="triton"`` on CUDA or ``"reference"``).

16-bit rows (tried on CPU): BF16 weights fail in the CPU forward ("not implemented for
'BFloat16'"); FP16 weights train but the CPU update rounds to nearest (an update below
half a 16-bit step leaves the row unchanged, ``stochastic_rounding=True`` or not), so
both are refused on CPU. On CUDA the TBE stores FP16 or BF16 weights
(``weights_precision``) with float32 optimizer state and FBGEMM's own stochastic
rounding (its RNG is FBGEMM's, not saved in checkpoints); that path has not run here,
as no CUDA machine with FBGEMM was available.

Shapes: B batch, S features a pack declares, F_p of them in the batch, D dim, R rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from recaccel.ops.embedding.lookup_out import as_out_dtype
from recaccel.ops.embedding.packing import PackLayout, gather_pack_ids
from recaccel.ops.embedding.prepared import PackBatch, PreparedPack
from recaccel.ops.embedding.specs import OPTIMIZER_STATES, OPTIMIZERS, SparseOptimConfig, TableSpec

if TYPE_CHECKING:
    from recaccel.ops.embedding.pack_backend import PackOptions

# The sparse optimizers this backend runs, by name, with FBGEMM's rule for each.
_FBGEMM_RULES = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}
# FBGEMM's weights_precision of each row dtype (read off SparseType when the TBE is built).
_SPARSE_TYPES = {
    torch.float32: lambda t: t.FP32,
    torch.bfloat16: lambda t: t.BF16,
    torch.float16: lambda t: t.FP16,
}
FBGEMM_OPTIMIZERS = tuple(name for name in OPTIMIZERS if name in _FBGEMM_RULES)  # a subset, in that order


def fbgemm_unsupported(
    tables: list[TableSpec],
    mode: str,
    optim: SparseOptimConfig,
    dtype: str = "fp32",
    device: torch.device | None = None,
) -> str | None:
    """Why the FBGEMM backend cannot run these tables, options and row dtype on ``device``
    (CPU when None), or None when it can."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if dtype != "fp32" and not on_cuda:
        return (
            f"{dtype} rows on CPU (fbgemm-gpu-cpu 1.8.0 has no bf16 CPU kernels and rounds fp16 updates "
            "to nearest, without stochastic rounding; use backend='reference' or 'triton')"
        )
    if mode != "fused":
        return f"mode={mode!r} (FBGEMM applies the optimizer inside its backward; use mode='fused')"
    if optim.weight_decay > 0:
        return f"weight_decay={optim.weight_decay} (fbgemm-gpu-cpu 1.8.0 silently ignores weight decay)"
    for t in tables:
        if t.optimizer not in FBGEMM_OPTIMIZERS:
            return (
                f"optimizer {t.optimizer!r} of table {t.name!r} (this backend supports {FBGEMM_OPTIMIZERS}; "
                "fbgemm-gpu-cpu has no Adam on CPU)"
            )
        if t.dim % 4:
            return f"dim {t.dim} of table {t.name!r} (FBGEMM needs a multiple of 4)"
    return None


class FbgemmPack:
    """One pack held by an FBGEMM TBE (a :class:`~recaccel.ops.embedding.pack_backend.PackBackend`).

    It is deliberately not an ``nn.Module`` attribute of the owning module: its weights
    are a Parameter of the TBE that must not appear in ``model.parameters()`` (the dense
    optimizer would step them again), nor its internal buffers in the state dict. So it
    holds no tensors on the module (``held`` is empty), and ``.to()`` does not move it.

    Args:
        layout: The pack.
        optim: Sparse optimizer hyper-parameters.
        device: CPU (rows in host memory) or CUDA (rows in device memory).
        weights: Initial float32 [R_t, D] rows of each table of the pack.
    """

    def __init__(
        self,
        layout: PackLayout,
        optim: SparseOptimConfig,
        device: torch.device,
        weights: list[Tensor],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        on_gpu = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
        self.layout = layout
        self.dim = layout.dim
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(t.num_rows, t.dim, location, compute) for t in layout.tables],
            feature_table_map=[i for i, t in enumerate(layout.tables) for _ in t.features],
            optimizer=getattr(EmbOptimType, _FBGEMM_RULES[layout.optimizer]),
            learning_rate=optim.lr,
            eps=optim.eps,
            pooling_mode=PoolingMode.SUM,
            device=device,
            # recaccel checks ids itself, once per batch for all packs.
            bounds_check_mode=BoundsCheckMode.NONE,
            weights_precision=_SPARSE_TYPES[dtype](SparseType),
            stochastic_rounding=True,
        )
        with torch.no_grad():
            for view, w in zip(self.tbe.split_embedding_weights(), weights):
                view.copy_(w)

    always_checks_ids: ClassVar[bool] = False

    @classmethod
    def create(
        cls, layout: PackLayout, weights: list[Tensor], options: PackOptions, device: torch.device
    ) -> tuple[FbgemmPack, dict[str, Tensor]]:
        """The pack (fused mode: :func:`fbgemm_unsupported` has ruled out the others), and
        no tensors for the module to hold. ``options.rounding`` is unused: FBGEMM rounds 16-bit
        rows with its own RNG."""
        return cls(layout, options.optim, device, weights, options.dtype), {}

    @property
    def device(self) -> torch.device:
        return self.tbe.weights_host.device if self.tbe.weights_host.numel() else self.tbe.weights_dev.device

    def check_batch_device(self, held: Mapping[str, Tensor], device: torch.device) -> None:
        """Nothing here: :meth:`lookup` says where the tables live and how to move them."""

    def table_tensors(self, held: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """Per table of the pack: views of its rows [R, D] and optimizer state, by checkpoint name."""
        weights = self.tbe.split_embedding_weights()
        states = self.tbe.split_optimizer_states() if OPTIMIZER_STATES[self.layout.optimizer] else None
        out = []
        for i, table in enumerate(self.layout.tables):
            tensors = {"weight": weights[i]}
            for j, (name, rowwise) in enumerate(OPTIMIZER_STATES[table.optimizer]):
                state = states[i][j].detach()
                tensors[name] = state.view(table.num_rows) if rowwise else state.view(-1, table.dim)
            out.append(tensors)
        return out

    def set_learning_rate(self, lr: float) -> None:
        self.tbe.set_learning_rate(lr)

    def prepare(self, batch: PackBatch) -> PreparedPack | None:
        """Nothing: :meth:`lookup` builds the TBE's input itself."""
        return None

    def lookup(self, held: Mapping[str, Tensor], batch: PackBatch) -> Tensor:
        """Pools the pack's features of a batch.

        Args:
            held: Unused (empty).
            batch: The batch (``prepared`` unused); ``batch.train``: let backward update the
                rows (training), otherwise no graph is built.

        Returns:
            float32 [B, F_p, D] in the batch's feature order.
        """
        sf, route, batch_size = batch.sf, batch.route, batch.batch_size
        if sf.values.device != self.device:
            raise ValueError(
                f"the fbgemm backend's tables live on {self.device} (fixed at construction) but the batch is "
                f"on {sf.values.device}; build the module with device={sf.values.device}"
            )
        # The TBE takes int32 or int64 indices and offsets, both of one dtype: gather_pack_ids' contract.
        ids = gather_pack_ids(sf, route.slots, batch_size)
        with torch.set_grad_enabled(batch.train and torch.is_grad_enabled()):
            pooled = self.tbe(ids.rows, ids.offsets, ids.scale)
        out = pooled.view(batch_size, route.slots.count, self.dim)
        if route.slots.identity:
            return out
        return out.index_select(1, route.slot_of_local)

    def lookup_rows(
        self,
        held: Mapping[str, Tensor],
        batch: PackBatch,
        lo: int,
        hi: int,
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Rows ``lo:hi`` of :meth:`lookup`, without a graph: the TBE looks up those rows of
        the batch (one host synchronization to cut them out), cast to ``out_dtype``."""
        rows = PackBatch(batch.sf.slice_rows(lo, hi), batch.route, hi - lo, train=False)
        return as_out_dtype(self.lookup(held, rows), out_dtype)

    def deferred_update_unsupported(self) -> str | None:
        return (
            "backend='fbgemm' (its sparse update runs inside the TBE's backward, which a gradient cannot be "
            "handed to; use backend='reference' or 'triton')"
        )

    def apply_gradient(self, held: Mapping[str, Tensor], batch: PackBatch, grad: Tensor) -> None:
        raise ValueError(f"cannot apply a deferred update: {self.deferred_update_unsupported()}")
