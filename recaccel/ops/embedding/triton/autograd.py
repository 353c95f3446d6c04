"""Autograd Functions over the Triton packed embedding bag kernels.

- :class:`TritonEmbeddingBagFunction` (autograd mode): the packed weight is an input and
  backward returns its gradient, dense [R, D] or sparse COO (U rows).
- :class:`TritonFusedEmbeddingBagFunction` (fused mode): the packed weight is a buffer;
  backward deduplicates rows and updates them and their optimizer state in place.

The ids' per-occurrence bookkeeping (:func:`gather_pack_ids`) is recomputed in backward
from the batch's CSR rather than kept alive between the passes.

Shapes: B batch, S features of the pack, D dim, R packed rows, U unique rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.ops.embedding.optimizers import PackState
from recaccel.ops.embedding.packing import LocalFeatures, gather_pack_ids
from recaccel.ops.embedding.specs import SparseOptimConfig
from recaccel.ops.embedding.triton.kernels import embedding_bag_backward, embedding_bag_forward, fused_update
from recaccel.sparse import SparseFeatures


class TritonEmbeddingBagFunction(torch.autograd.Function):
    """Pooled lookup of one pack with a gradient for its packed weight."""

    @staticmethod
    def forward(
        ctx, weight: Tensor, sf: SparseFeatures, local: LocalFeatures, batch_size: int, sparse_grad: bool
    ) -> Tensor:
        ctx.sf, ctx.local, ctx.batch_size, ctx.sparse_grad = sf, local, batch_size, sparse_grad
        ctx.weight_shape = weight.shape
        return embedding_bag_forward(weight, sf, local, batch_size)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        ids = gather_pack_ids(ctx.sf, ctx.local, ctx.batch_size, with_bags=True)
        rows, grad_rows = embedding_bag_backward(grad_out, ids, ctx.batch_size)
        if ctx.sparse_grad:
            grad = torch.sparse_coo_tensor(
                rows[None], grad_rows, ctx.weight_shape, is_coalesced=True, check_invariants=False
            )
        else:
            grad = grad_rows.new_zeros(ctx.weight_shape).index_copy_(0, rows, grad_rows)
        return grad, None, None, None, None


class TritonFusedEmbeddingBagFunction(torch.autograd.Function):
    """Pooled lookup of one pack whose backward applies the sparse optimizer in place.

    ``anchor`` is an empty tensor that requires grad, so that autograd calls
    :meth:`backward` although the packed weight is a buffer.
    """

    @staticmethod
    def forward(
        ctx,
        anchor: Tensor,
        state: PackState,
        optim: SparseOptimConfig,
        sf: SparseFeatures,
        local: LocalFeatures,
        batch_size: int,
    ) -> Tensor:
        ctx.state, ctx.optim, ctx.sf, ctx.local, ctx.batch_size = state, optim, sf, local, batch_size
        return embedding_bag_forward(state.weight, sf, local, batch_size)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        ids = gather_pack_ids(ctx.sf, ctx.local, ctx.batch_size, with_bags=True)
        fused_update(ctx.state, ctx.optim, grad_out, ids, ctx.batch_size)
        return None, None, None, None, None, None
