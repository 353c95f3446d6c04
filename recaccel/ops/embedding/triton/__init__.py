"""Triton backend of the packed embedding bag: kernels, their autograd Functions, the pack.

- :mod:`recaccel.ops.embedding.triton.backward`: the backward and fused sparse update
  as occurrence tiles (what both modes run).
- :mod:`recaccel.ops.embedding.triton.forward`: the forward as bag tiles.
- :mod:`recaccel.ops.embedding.triton.rounding`: stochastic rounding of 16-bit rows
  inside the kernels.
- :mod:`recaccel.ops.embedding.triton.autograd`: the autograd Functions of autograd
  mode (a gradient for the packed weight) and fused mode (the update in backward).
- :class:`TritonPack`: one pack of a :class:`~recaccel.ops.embedding.PackedEmbeddingBag`
  on this backend.

They run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
these modules are first imported).

Shapes: B batch, S features of the pack, D dim, R packed rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.ops.embedding.optimizers import PackState
from recaccel.ops.embedding.pack_backend import HeldPack, PackOptions
from recaccel.ops.embedding.packing import LocalFeatures, PackLayout, PackRoute, gather_pack_ids, group_by_row
from recaccel.ops.embedding.prepared import PreparedPack
from recaccel.ops.embedding.triton.autograd import (
    TritonEmbeddingBagFunction,
    TritonFusedEmbeddingBagFunction,
)
from recaccel.ops.embedding.triton.backward import fused_update
from recaccel.ops.embedding.triton.forward import (
    check_forward_launchable,
    embedding_bag_forward,
    embedding_bag_forward_rows,
)
from recaccel.sparse import SparseFeatures

__all__ = [
    "TritonEmbeddingBagFunction",
    "TritonFusedEmbeddingBagFunction",
    "TritonPack",
    "embedding_bag_forward",
]


class TritonPack(HeldPack):
    """One pack on the Triton backend (see :class:`~recaccel.ops.embedding.pack_backend.HeldPack`).

    Ids are checked only when the module's ``bounds_check`` is on. The forward reads the
    batch's CSR directly, so only a training step is prepared: the ids with their bags
    and their grouping by row, for the backward.
    """

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

    def prepare(
        self, sf: SparseFeatures, route: PackRoute, batch_size: int, train: bool
    ) -> PreparedPack | None:
        if not train:
            return None
        ids = gather_pack_ids(sf, route.local, batch_size, with_bags=True)
        # The fused update reads only the sort order: no unique rows, no host sync.
        groups = group_by_row(ids.rows, self.layout.num_rows, unique=self.mode == "autograd")
        return PreparedPack(ids, groups)

    def lookup_autograd(
        self,
        weight: Tensor,
        sf: SparseFeatures,
        local: LocalFeatures,
        prepared: PreparedPack | None,
        batch_size: int,
    ) -> Tensor:
        return TritonEmbeddingBagFunction.apply(weight, sf, local, prepared, batch_size, self.sparse_grad)

    def lookup_frozen(
        self,
        weight: Tensor,
        sf: SparseFeatures,
        local: LocalFeatures,
        prepared: PreparedPack | None,
        batch_size: int,
    ) -> Tensor:
        return embedding_bag_forward(weight, sf, local, batch_size)

    def lookup_fused(
        self,
        anchor: Tensor,
        state: PackState,
        sf: SparseFeatures,
        local: LocalFeatures,
        prepared: PreparedPack | None,
        batch_size: int,
    ) -> Tensor:
        return TritonFusedEmbeddingBagFunction.apply(
            anchor, state, self.optim, sf, local, prepared, batch_size
        )

    def pool_rows(
        self,
        weight: Tensor,
        sf: SparseFeatures,
        local: LocalFeatures,
        prepared: PreparedPack | None,
        batch_size: int,
        lo: int,
        hi: int,
    ) -> Tensor:
        return embedding_bag_forward_rows(weight, sf, local, batch_size, lo, hi)

    def update(self, state: PackState, grad: Tensor, prepared: PreparedPack | None, batch_size: int) -> None:
        # What TritonFusedEmbeddingBagFunction.backward runs, on this gradient.
        fused_update(state, self.optim, grad, prepared.ids, batch_size, prepared.groups)
