"""Triton backend of the packed embedding bag: kernels, their autograd Functions, the pack.

- :mod:`recaccel.ops.embedding.triton.kernels`: forward, backward and fused
  sparse-optimizer kernels with their launchers.
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
from recaccel.ops.embedding.packing import LocalFeatures, PackLayout
from recaccel.ops.embedding.triton.autograd import TritonEmbeddingBagFunction, TritonFusedEmbeddingBagFunction
from recaccel.ops.embedding.triton.kernels import check_kernels_launchable, embedding_bag_forward
from recaccel.sparse import SparseFeatures

__all__ = [
    "TritonEmbeddingBagFunction",
    "TritonFusedEmbeddingBagFunction",
    "TritonPack",
    "embedding_bag_forward",
]


class TritonPack(HeldPack):
    """One pack on the Triton backend (see :class:`~recaccel.ops.embedding.pack_backend.HeldPack`).

    Ids are checked only when the module's ``bounds_check`` is on.
    """

    @classmethod
    def create(
        cls, layout: PackLayout, weights: list[Tensor], options: PackOptions, device: torch.device
    ) -> tuple[TritonPack, dict[str, Tensor]]:
        """See :meth:`HeldPack.create`.

        Raises:
            BackendUnavailableError: CPU tensors and compiled (not interpreted) kernels.
        """
        check_kernels_launchable(device)
        return super().create(layout, weights, options, device)

    def lookup_autograd(
        self, weight: Tensor, sf: SparseFeatures, local: LocalFeatures, batch_size: int
    ) -> Tensor:
        return TritonEmbeddingBagFunction.apply(weight, sf, local, batch_size, self.sparse_grad)

    def lookup_frozen(
        self, weight: Tensor, sf: SparseFeatures, local: LocalFeatures, batch_size: int
    ) -> Tensor:
        return embedding_bag_forward(weight, sf, local, batch_size)

    def lookup_fused(
        self, anchor: Tensor, state: PackState, sf: SparseFeatures, local: LocalFeatures, batch_size: int
    ) -> Tensor:
        return TritonFusedEmbeddingBagFunction.apply(anchor, state, self.optim, sf, local, batch_size)
