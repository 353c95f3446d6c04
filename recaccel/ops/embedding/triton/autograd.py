"""Autograd Functions over the Triton packed embedding bag kernels.

- :class:`TritonEmbeddingBagFunction` (autograd mode): the packed weight is an input and
  backward returns its gradient, dense [R, D] or sparse COO (U rows).
- :class:`TritonFusedEmbeddingBagFunction` (fused mode): the packed weight is a buffer;
  backward deduplicates rows and updates them and their optimizer state in place
  (:func:`~recaccel.ops.embedding.triton.backward.fused_update`, which
  ``apply_gradient`` runs too).

Both take an optional ``out`` [B, S, D] the forward writes into (a CUDA-graphed head's
input buffer: :mod:`~recaccel.ops.embedding.lookup_out`) and returns. The forward reads
the batch's CSR directly; the backward takes the ids with their bags
and row grouping from the batch's preparation (made for training, so kept alive between
the passes: see :mod:`recaccel.ops.embedding.prepared` for the memory), or makes them
from the CSR when the lookup was not prepared for training (a backward through an
autograd-mode lookup in eval mode).

Shapes: B batch, S features of the pack, D dim, R packed rows, U unique rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.ops.embedding.optimizers import PackState
from recaccel.ops.embedding.prepared import PackBatch, PreparedPack
from recaccel.ops.embedding.row_groups import group_by_row
from recaccel.ops.embedding.specs import SparseOptimConfig
from recaccel.ops.embedding.triton.backward import embedding_bag_backward, fused_update
from recaccel.ops.embedding.triton.forward import embedding_bag_forward
from recaccel.ops.embedding.triton.pack_ids import backward_pack_ids


def backward_ids(batch: PackBatch) -> PreparedPack:
    """The ids with bags and row grouping of a pack's backward: the preparation's when it
    was made for training, else made now from the batch's CSR."""
    prepared = batch.prepared
    if prepared is not None and prepared.groups is not None:
        return prepared
    ids = backward_pack_ids(batch)
    return PreparedPack(ids, group_by_row(ids.rows))


def mark_out(ctx, out: Tensor | None) -> None:
    """A caller's ``out`` is an input the forward writes into and returns: marked dirty, so
    the returned ``out`` carries this node."""
    if out is not None:
        ctx.mark_dirty(out)


class TritonEmbeddingBagFunction(torch.autograd.Function):
    """Pooled lookup of one pack with a gradient for its packed weight [R, D]."""

    @staticmethod
    def forward(
        ctx, weight: Tensor, batch: PackBatch, sparse_grad: bool, out: Tensor | None = None
    ) -> Tensor:
        ctx.batch, ctx.sparse_grad = batch, sparse_grad
        ctx.weight_shape = weight.shape
        mark_out(ctx, out)
        return embedding_bag_forward(weight, batch.sf, batch.local, batch.batch_size, out=out)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        batch = ctx.batch
        prepared = backward_ids(batch)
        rows, grad_rows = embedding_bag_backward(grad_out, prepared.ids, batch.batch_size, prepared.groups)
        if ctx.sparse_grad:
            grad = torch.sparse_coo_tensor(
                rows[None], grad_rows, ctx.weight_shape, is_coalesced=True, check_invariants=False
            )
        else:
            grad = grad_rows.new_zeros(ctx.weight_shape).index_copy_(0, rows, grad_rows)
        return grad, None, None, None


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
        batch: PackBatch,
        out: Tensor | None = None,
    ) -> Tensor:
        ctx.state, ctx.optim, ctx.batch = state, optim, batch
        mark_out(ctx, out)
        return embedding_bag_forward(state.weight, batch.sf, batch.local, batch.batch_size, out=out)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        batch = ctx.batch
        prepared = backward_ids(batch)
        fused_update(
            ctx.state, ctx.optim, grad_out, prepared.ids, batch.batch_size, prepared.groups,
            occurrences=prepared.sorted,
        )  # fmt: skip
        return None, None, None, None, None
