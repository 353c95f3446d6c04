"""Triton backend of the packed embedding bag: kernels, their autograd Functions, the pack.

- :mod:`recaccel.ops.embedding.triton.backward`: the backward and fused sparse update
  as occurrence tiles (what both modes run).
- :mod:`recaccel.ops.embedding.triton.forward`: the forward as bag tiles.
- :mod:`recaccel.ops.embedding.triton.rounding`: stochastic rounding of 16-bit rows
  inside the kernels.
- :mod:`recaccel.ops.embedding.triton.pack_ids`: a training batch's rows, bags, scales
  and bounds check in one pass (what the backward's sort and kernels read).
- :mod:`recaccel.ops.embedding.triton.autograd`: the autograd Functions of autograd
  mode (a gradient for the packed weight) and fused mode (the update in backward).
- :class:`TritonPack`: one pack of a :class:`~recaccel.ops.embedding.PackedEmbeddingBag`
  on this backend.

They run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
these modules are first imported).

Shapes: B batch, S features of the pack, D dim, R packed rows.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from recaccel.ops.embedding.optimizers import PackState
from recaccel.ops.embedding.pack_backend import HeldPack, PackOptions
from recaccel.ops.embedding.packing import PackLayout
from recaccel.ops.embedding.prepared import PackBatch, PreparedPack
from recaccel.ops.embedding.row_groups import RowGroups
from recaccel.ops.embedding.triton.autograd import (
    TritonEmbeddingBagFunction,
    TritonFusedEmbeddingBagFunction,
)
from recaccel.ops.embedding.triton.backward import fused_update, tile_config
from recaccel.ops.embedding.triton.backward_config import density_bucket
from recaccel.ops.embedding.triton.forward import (
    check_forward_launchable,
    embedding_bag_forward,
    embedding_bag_forward_rows,
)
from recaccel.ops.embedding.triton.occurrences import piece_len_of, sort_occurrences
from recaccel.ops.embedding.triton.pack_ids import backward_pack_ids

__all__ = [
    "TritonEmbeddingBagFunction",
    "TritonFusedEmbeddingBagFunction",
    "TritonPack",
    "embedding_bag_forward",
]


class TritonPack(HeldPack):
    """One pack on the Triton backend (see :class:`~recaccel.ops.embedding.pack_backend.HeldPack`).

    Ids are checked only when the module's ``bounds_check`` is on. The forward reads the
    batch's CSR directly (int32 or int64 ids and offsets alike), so only a training step
    is prepared: the ids with their bags and their grouping by row, for the backward, and
    in fused mode the occurrences in sorted order as the update's kernels walk them
    (made right after the sort, on the preparing stream).
    """

    writes_out = True

    def __init__(self, layout: PackLayout, options: PackOptions) -> None:
        super().__init__(layout, options)
        self.dtype = options.dtype

    @classmethod
    def create(
        cls, layout: PackLayout, weights: list[Tensor], options: PackOptions, device: torch.device
    ) -> tuple[TritonPack, dict[str, Tensor]]:
        """See :meth:`HeldPack.create`.

        Raises:
            BackendUnavailableError: CPU tensors and compiled (not interpreted) kernels.
        """
        check_forward_launchable(device)  # every kernel of the backend runs where the forward does
        return super().create(layout, weights, options, device)

    def prepare(self, batch: PackBatch) -> PreparedPack | None:
        if not batch.train:
            return None
        ids = backward_pack_ids(batch)
        prepared = PreparedPack(ids)
        if self.mode == "autograd":
            prepared.groups = batch.group(ids.rows, self.layout.num_rows, unique=True)
        else:  # the fused update reads only the sort: no unique rows, no host sync
            then = functools.partial(self._sort_occurrences, prepared)
            prepared.groups = batch.group(ids.rows, self.layout.num_rows, unique=False, then=then)
        return prepared

    def _sort_occurrences(self, prepared: PreparedPack, groups: RowGroups) -> None:
        """The fused update's sorted occurrences (and pieces, for the piece lanes), made once
        the batch's sort has run."""
        rows = prepared.ids.rows
        density = density_bucket(rows.numel(), self.layout.num_rows)
        config = tile_config(self.layout.dim, self.dtype, rows.device, density)
        prepared.sorted = sort_occurrences(prepared.ids, groups, piece_len_of(config))

    def lookup_autograd(self, weight: Tensor, batch: PackBatch, out: Tensor | None = None) -> Tensor:
        return TritonEmbeddingBagFunction.apply(weight, batch, self.sparse_grad, out)

    def lookup_frozen(self, weight: Tensor, batch: PackBatch, out: Tensor | None = None) -> Tensor:
        return embedding_bag_forward(weight, batch.sf, batch.local, batch.batch_size, out=out)

    def lookup_fused(
        self, anchor: Tensor, state: PackState, batch: PackBatch, out: Tensor | None = None
    ) -> Tensor:
        return TritonFusedEmbeddingBagFunction.apply(anchor, state, self.optim, batch, out)

    def pool_rows(
        self, weight: Tensor, batch: PackBatch, lo: int, hi: int, out_dtype: torch.dtype | None
    ) -> Tensor:
        dtype = torch.float32 if out_dtype is None else out_dtype  # the kernel stores it
        return embedding_bag_forward_rows(
            weight, batch.sf, batch.local, batch.batch_size, lo, hi, out_dtype=dtype
        )

    def update(self, state: PackState, grad: Tensor, batch: PackBatch) -> None:
        # What TritonFusedEmbeddingBagFunction.backward runs, on this gradient.
        prepared = batch.prepared
        fused_update(
            state,
            self.optim,
            grad,
            prepared.ids,
            batch.batch_size,
            prepared.groups,
            occurrences=prepared.sorted,
        )
