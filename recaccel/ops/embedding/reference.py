"""Reference packed embedding bag: plain PyTorch, runs anywhere, defines the semantics.

One ``torch.nn.functional.embedding_bag`` per pack looks up every feature of the pack:
ids are shifted by their table's row offset (:func:`gather_pack_ids`, made when the
batch is prepared) and pooled with ``mode="sum"`` and per-id scales (the id's weight,
times ``1/L`` for mean pooling).

:class:`ReferencePack` is the reference backend of one pack of a
:class:`~recaccel.ops.embedding.PackedEmbeddingBag`. Fused mode wraps the lookup in
:class:`ReferenceFusedLookup`, whose backward (:func:`fused_backward`) takes the ids
grouped by row (sorted when the batch was prepared), sums each unique row's occurrence
gradients (one ``embedding_bag`` over the output gradient) and applies the sparse
optimizer to those rows, a piece of rows at a time
(:func:`~recaccel.ops.embedding.optimizers.rows_per_piece`); no dense [R, D] gradient
exists.

Shapes: B batch, S features of the pack, D dim, N_p ids of the pack, U unique rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from recaccel.ops.embedding.lookup_out import as_out_dtype
from recaccel.ops.embedding.optimizers import PackState, rows_per_piece, update_rows
from recaccel.ops.embedding.pack_backend import HeldPack
from recaccel.ops.embedding.packing import PackIds, slice_pack_ids
from recaccel.ops.embedding.prepared import PackBatch, PreparedPack
from recaccel.ops.embedding.row_groups import RowGroups, group_by_row
from recaccel.ops.embedding.specs import SparseOptimConfig


def reference_lookup(
    weight: Tensor, ids: PackIds, batch_size: int, num_local: int, *, sparse_grad: bool = False
) -> Tensor:
    """Pools one pack's bags.

    Args:
        weight: [R, D] packed rows (a float32 Parameter in autograd mode; float32,
            bfloat16 or float16 buffer in fused mode).
        ids: The pack's ids (:func:`gather_pack_ids`).
        batch_size: B.
        num_local: S.
        sparse_grad: Give ``weight`` a sparse COO gradient instead of a dense one.

    Returns:
        float32 [B, S, D]; an empty bag pools to zeros.
    """
    dim = weight.shape[1]
    sixteen_bit = weight.dtype in (torch.bfloat16, torch.float16)
    out_dtype = torch.float32 if sixteen_bit else weight.dtype  # float64 models stay float64
    if batch_size * num_local == 0:
        return torch.zeros(batch_size, num_local, dim, device=weight.device, dtype=out_dtype)
    rows = ids.rows
    if sixteen_bit:
        # 16-bit rows: gather and upcast the ids' rows, then pool them in float32.
        weight = weight.index_select(0, rows).float()
        rows = torch.arange(rows.numel(), dtype=ids.offsets.dtype, device=rows.device)
    pooled = F.embedding_bag(
        rows,
        weight,
        ids.offsets,
        mode="sum",
        sparse=sparse_grad,
        per_sample_weights=ids.scale,
        include_last_offset=True,
    )
    return pooled.view(num_local, batch_size, dim).transpose(0, 1)


def coalesce_row_grads(
    grad_out: Tensor, ids: PackIds, *, max_rows: int | None = None, groups: RowGroups | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """Sums the gradient of every occurrence of each unique row, in pieces of rows.

    The ids are sorted by row (stable: a row's occurrences keep their order); then each
    piece of unique rows pools its occurrences' output gradients with one
    ``embedding_bag`` (a row is a "bag" of the output-gradient rows of its occurrences,
    weighted by their scale), which fuses the gather, the scaling and the sum.

    Args:
        grad_out: [B, S, D] gradient of the pooled output.
        ids: The pack's ids, with ``bags``.
        max_rows: Unique rows per piece (default :func:`rows_per_piece` of D).
        groups: ``group_by_row(ids.rows)`` when already made (a prepared batch).

    Yields:
        (rows int64 [U_k] unique packed rows, grad float32 [U_k, D]); the pieces cover the
        sorted unique rows in ascending order.
    """
    b, s, dim = grad_out.shape
    max_rows = rows_per_piece(dim) if max_rows is None else max_rows
    grad_out = grad_out.to(torch.float32)
    # Bag j*B + b of the pack is output row (b, j): read a contiguous grad_out where it lies
    # rather than copying it to feature-major order.
    in_place = grad_out.is_contiguous()
    table = grad_out.view(b * s, dim) if in_place else grad_out.transpose(0, 1).reshape(b * s, dim)
    order, rows, segments = group_by_row(ids.rows) if groups is None else groups
    num_unique = rows.numel()
    starts = list(range(0, num_unique, max_rows))
    # One host read for all the pieces' bounds.
    bounds = segments[starts + [num_unique]].tolist()
    for k, u0 in enumerate(starts):
        u1 = min(u0 + max_rows, num_unique)
        lo, hi = bounds[k], bounds[k + 1]
        occ = order[lo:hi]
        bags = ids.bags.index_select(0, occ)
        if in_place:
            bags = (bags % b) * s + bags // b
        scale = None if ids.scale is None else ids.scale.index_select(0, occ)
        grad = F.embedding_bag(
            bags, table, segments[u0 : u1 + 1] - lo, mode="sum", per_sample_weights=scale,
            include_last_offset=True,
        )  # fmt: skip
        yield rows[u0:u1], grad


def fused_backward(
    state: PackState, optim: SparseOptimConfig, grad_out: Tensor, prepared: PreparedPack
) -> None:
    """The fused update of one pack for one batch (the backward of :class:`ReferenceFusedLookup`,
    and :meth:`PackedEmbeddingBag.apply_gradient`'s): counts the step, draws the
    rounding seed of 16-bit rows, then updates the touched rows piece by piece.

    Args:
        state: The pack's rows, optimizer state and step, updated in place.
        optim: Hyper-parameters.
        grad_out: [B, S, D] gradient of the pack's pooled output.
        prepared: The batch's preparation (ids with bags; the row grouping when made for
            training, else it is made here).
    """
    state.step.add_(1)
    seed = None if state.rounding_seed is None else state.rounding_seed()
    for rows, grad in coalesce_row_grads(grad_out, prepared.ids, groups=prepared.groups):
        update_rows(state, optim, rows, grad, seed)


class ReferenceFusedLookup(torch.autograd.Function):
    """Pooled lookup whose backward updates the packed rows in place.

    ``anchor`` is an empty tensor that requires grad: the weights are buffers, so
    without it autograd would never call :meth:`backward`.
    """

    @staticmethod
    def forward(ctx, anchor: Tensor, state: PackState, optim: SparseOptimConfig, batch: PackBatch) -> Tensor:
        with torch.no_grad():
            out = reference_lookup(state.weight, batch.prepared.ids, batch.batch_size, batch.local.count)
        ctx.prepared, ctx.state, ctx.optim = batch.prepared, state, optim
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        fused_backward(ctx.state, ctx.optim, grad_out, ctx.prepared)
        return None, None, None, None


class ReferencePack(HeldPack):
    """One pack on the reference backend (see :class:`~recaccel.ops.embedding.pack_backend.HeldPack`).

    It checks every batch's ids: ``embedding_bag`` would index out of range otherwise.
    Its preparation is the pack's ids (with their bags and row grouping for a fused
    training step), which its forward, backward and :meth:`pool_rows` all read. int32
    ids and offsets stay int32 (``embedding_bag`` takes either, both of one dtype).
    """

    always_checks_ids = True

    def prepare(self, batch: PackBatch) -> PreparedPack:
        backward = batch.train and self.mode == "fused"  # autograd mode: embedding_bag's own backward
        ids = batch.pack_ids(with_bags=backward)
        return PreparedPack(
            ids, batch.group(ids.rows, self.layout.num_rows, unique=True) if backward else None
        )

    def lookup_autograd(self, weight: Tensor, batch: PackBatch) -> Tensor:
        ids, count = batch.prepared.ids, batch.local.count
        return reference_lookup(weight, ids, batch.batch_size, count, sparse_grad=self.sparse_grad)

    lookup_frozen = lookup_autograd  # a buffer: no gradient, hence no graph

    def lookup_fused(self, anchor: Tensor, state: PackState, batch: PackBatch) -> Tensor:
        return ReferenceFusedLookup.apply(anchor, state, self.optim, batch)

    def pool_rows(
        self, weight: Tensor, batch: PackBatch, lo: int, hi: int, out_dtype: torch.dtype | None
    ) -> Tensor:
        count = batch.local.count
        ids = slice_pack_ids(batch.prepared.ids, batch.batch_size, count, lo, hi)
        return as_out_dtype(reference_lookup(weight, ids, hi - lo, count), out_dtype)

    def update(self, state: PackState, grad: Tensor, batch: PackBatch) -> None:
        if grad.dtype in (torch.bfloat16, torch.float16):
            grad = grad.float()  # a 16-bit output's gradient, read as autograd's cast back would
        fused_backward(state, self.optim, grad, batch.prepared)
