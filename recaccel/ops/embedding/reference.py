"""Reference packed embedding bag: plain PyTorch, runs anywhere, defines the semantics.

One ``torch.nn.functional.embedding_bag`` per pack looks up every feature of the pack:
ids are shifted by their table's row offset (:func:`gather_pack_ids`) and pooled with
``mode="sum"`` and per-id scales (the id's weight, times ``1/L`` for mean pooling).

Fused mode wraps it in :class:`ReferenceFusedLookup`, whose backward computes each
occurrence's gradient, sums duplicates per unique row (``torch.unique`` + ``index_add``)
and applies the sparse optimizer to those rows; no dense [R, D] gradient exists.

Shapes: B batch, S features of the pack, D dim, N_p ids of the pack, U unique rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from recaccel.io.batch import SparseFeatures
from recaccel.ops.embedding.optimizers import PackState, reference_update
from recaccel.ops.embedding.packing import LocalFeatures, PackIds, gather_pack_ids
from recaccel.ops.embedding.specs import SparseOptimConfig


def reference_lookup(
    weight: Tensor, ids: PackIds, batch_size: int, num_local: int, *, sparse_grad: bool = False
) -> Tensor:
    """Pools one pack's bags.

    Args:
        weight: float32 [R, D] packed rows (a Parameter in autograd mode).
        ids: The pack's ids (:func:`gather_pack_ids`).
        batch_size: B.
        num_local: S.
        sparse_grad: Give ``weight`` a sparse COO gradient instead of a dense one.

    Returns:
        float32 [B, S, D]; an empty bag pools to zeros.
    """
    dim = weight.shape[1]
    if batch_size * num_local == 0:
        return weight.new_zeros(batch_size, num_local, dim)
    pooled = F.embedding_bag(
        ids.rows,
        weight,
        ids.offsets,
        mode="sum",
        sparse=sparse_grad,
        per_sample_weights=ids.scale,
        include_last_offset=True,
    )
    return pooled.view(num_local, batch_size, dim).transpose(0, 1)


def coalesce_row_grads(grad_out: Tensor, ids: PackIds, batch_size: int) -> tuple[Tensor, Tensor]:
    """Sums the gradient of every occurrence of each unique row.

    Args:
        grad_out: [B, S, D] gradient of the pooled output.
        ids: The pack's ids, with ``bags``.
        batch_size: B.

    Returns:
        (rows int64 [U] sorted unique packed rows, grad float32 [U, D]).
    """
    dim = grad_out.shape[2]
    per_bag = grad_out.transpose(0, 1).reshape(-1, dim)
    per_id = per_bag[ids.bags]
    if ids.scale is not None:
        per_id = per_id * ids.scale[:, None]
    rows, inverse = torch.unique(ids.rows, return_inverse=True)
    grad = torch.zeros(rows.numel(), dim, dtype=torch.float32, device=grad_out.device)
    grad.index_add_(0, inverse, per_id.to(torch.float32))
    return rows, grad


class ReferenceFusedLookup(torch.autograd.Function):
    """Pooled lookup whose backward updates the packed rows in place.

    ``anchor`` is an empty tensor that requires grad: the weights are buffers, so
    without it autograd would never call :meth:`backward`.
    """

    @staticmethod
    def forward(
        ctx,
        anchor: Tensor,
        state: PackState,
        config: SparseOptimConfig,
        sf: SparseFeatures,
        local: LocalFeatures,
        batch_size: int,
    ) -> Tensor:
        ids = gather_pack_ids(sf, local, batch_size, with_bags=True)
        with torch.no_grad():
            out = reference_lookup(state.weight, ids, batch_size, local.count)
        ctx.ids, ctx.state, ctx.config, ctx.batch_size = ids, state, config, batch_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        rows, grad = coalesce_row_grads(grad_out, ctx.ids, ctx.batch_size)
        reference_update(ctx.state, ctx.config, rows, grad)
        return None, None, None, None, None, None
