"""The small arches a DLRM is composed of (as in TorchRec's DLRM).

Shapes: B batch, Dd dense features, F sparse fields, D embedding dim.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from recaccel.errors import ConfigError
from recaccel.models.fused_linear import dense_layer, fast_path_default
from recaccel.models.split_linear import WgradQueue, split_dense_layer
from recaccel.ops.interaction import (
    CROSS_KERNELS,
    dcnv2_cross,
    dot_interaction_pair,
    init_cross_weights,
    interaction_output_dim,
)
from recaccel.sparse import SparseFeatures


def mlp(in_features: int, layer_sizes: list[int], *, final_activation: bool) -> MLP:
    """Linear layers with ReLU between them (and after the last if ``final_activation``)."""
    layers: list[nn.Module] = []
    for i, out in enumerate(layer_sizes):
        layers.append(nn.Linear(in_features, out))
        if i < len(layer_sizes) - 1 or final_activation:
            layers.append(nn.ReLU())
        in_features = out
    return MLP(*layers)


class MLP(nn.Sequential):
    """An ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU`` that runs each Linear + ReLU
    pair as one GEMM with a bias + ReLU epilogue and pads unaligned inner dimensions
    (:mod:`recaccel.models.fused_linear`).

    Its modules, parameters and state_dict keys are those of the plain ``nn.Sequential``
    (``<2i>.weight``, ``<2i>.bias``), so checkpoints, TorchRec export and the meta
    engines, which walk the layers themselves, see no difference.

    Attributes:
        fused: bias + ReLU in the GEMM epilogue; None (default) = where
            :func:`~recaccel.models.fused_linear.fast_path_default` says (CUDA).
        align: pad inner dimensions to a multiple of 8; None (default) = likewise.
            With either on, the first layer also takes an input already padded to
            that width (extra columns meet zero weights).
        wgrad_queue: when set, a training forward's layers defer their weight gradients
            to this queue (:mod:`recaccel.models.split_linear`; ``train.pipeline =
            "overlap"``): ``.grad`` is filled when the queue runs, after ``backward()``.
    """

    fused: bool | None = None
    align: bool | None = None
    wgrad_queue: WgradQueue | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.run(x)

    def run(self, x: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """The output of modules ``[start:stop]`` (Python slice rules) applied to ``x``."""
        modules = list(self)[start:stop]
        fused, align = self.fused, self.align
        if fused is None or align is None:
            on = fast_path_default(x)
            fused = on if fused is None else fused
            align = on if align is None else align
        i = 0
        while i < len(modules):
            layer = modules[i]
            if not isinstance(layer, nn.Linear):
                x = layer(x)
                i += 1
                continue
            relu = i + 1 < len(modules) and isinstance(modules[i + 1], nn.ReLU)
            x = self._layer(x, layer, relu=relu, fused=fused, align=align)
            i += 2 if relu else 1
        return x

    def _layer(self, x: Tensor, layer: nn.Linear, *, relu: bool, fused: bool, align: bool) -> Tensor:
        queue = self.wgrad_queue
        if queue is not None and torch.is_grad_enabled() and layer.weight.requires_grad:
            return split_dense_layer(
                x, layer.weight, layer.bias, relu=relu, fused=fused, align=align, queue=queue
            )
        return dense_layer(x, layer.weight, layer.bias, relu=relu, fused=fused, align=align)


@runtime_checkable
class PreparesInput(Protocol):
    """An embedding module that can prepare a batch's lookup input ahead of the lookup."""

    def prepare(self, sparse: SparseFeatures) -> SparseFeatures:
        """``sparse`` with the lookup's input work done; the lookup of the result gives
        the lookup of ``sparse``, bit for bit."""
        ...


class SparseArch(nn.Module):
    """Pooled embeddings of every sparse field, in the model's field order.

    A batch meets the model here, by field name: its fields are put in :attr:`features`
    order (no copy when they already are, the common case) before the lookup, so the
    field axis of the output always means the same thing to the arches above, whatever
    order a batch (or a KeyedJaggedTensor from another pipeline) lists its keys in.

    Args:
        embedding: any module mapping SparseFeatures to [B, F, D] in the batch's field
            order: recaccel's packed embedding, the per-table baseline, or a TorchRec
            module wrapped to that shape.
        features: the F field names in the model's order; by default the embedding's
            own (see :func:`embedding_features`).
        autocast_output: under mixed precision, a packed embedding writes its pooled
            output in the autocast dtype (the Triton kernels pool in float32 and round
            once: half the bytes of the output and of its gradient). For consumers that
            cast the pooled embeddings to that dtype anyway, as DLRM's interaction arches
            do: the values they compute with are the same. Off: float32 output.

    Raises:
        ConfigError: ``features`` is not given and cannot be read off ``embedding``, or repeats.
    """

    def __init__(
        self, embedding: nn.Module, features: list[str] | None = None, *, autocast_output: bool = False
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.autocast_output = autocast_output
        self.features = list(features) if features is not None else embedding_features(embedding)
        if len(set(self.features)) != len(self.features):
            raise ConfigError(f"SparseArch: field names repeat: {self.features}")

    def prepare(self, sparse: SparseFeatures) -> SparseFeatures:
        """The batch's fields in :attr:`features` order, and, for an embedding that
        prepares its input ahead (:class:`PreparesInput`: the packed embedding's routing,
        bounds check and sort for the backward), prepared: :meth:`forward` then skips
        that work. The train pipeline calls this for the next batch on a side stream.

        Raises:
            DataError: the batch's fields are not the model's.
            InvalidIdError: an id outside its table.
        """
        ordered = sparse.reorder(self.features)
        if isinstance(self.embedding, PreparesInput):
            return self.embedding.prepare(ordered)
        return ordered

    def forward(self, sparse: SparseFeatures, *, out: Tensor | None = None) -> Tensor:
        """Returns [B, F, D], fields in :attr:`features` order (in :meth:`pooled_dtype`).

        Args:
            sparse: The batch.
            out: A packed embedding's buffer of that shape and dtype to write into (a
                CUDA-graphed head's input), returned.

        Raises:
            DataError: the batch lacks a field of the model or has one the model does not know.
        """
        device_type = sparse.values.device.type
        dtype = self.pooled_dtype(device_type)
        options = {} if out is None else {"out": out}
        if out is None and dtype != torch.float32:
            options["out_dtype"] = dtype
        # Under mixed precision the lookup pools in float32 (autocast off), its output float32
        # or, with autocast_output, the autocast dtype.
        mixed = torch.is_autocast_enabled(device_type)
        with torch.autocast(device_type, enabled=False) if mixed else contextlib.nullcontext():
            return self.embedding(sparse.reorder(self.features), **options)

    def pooled_dtype(self, device_type: str) -> torch.dtype:
        """The dtype of :meth:`forward`'s output under the current autocast state: the
        autocast dtype with ``autocast_output`` and a packed embedding, else float32."""
        from recaccel.ops.embedding import PackedEmbeddingBag

        packed = isinstance(self.embedding, PackedEmbeddingBag)
        if self.autocast_output and packed and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return torch.float32


def embedding_features(embedding: nn.Module) -> list[str]:
    """The field names an embedding module serves, in its table order.

    Reads ``embedding.features`` (per-table bags, TorchRec wrapper) or, for a packed
    embedding, the features of ``embedding.tables`` in order.

    Raises:
        ConfigError: the module declares neither.
    """
    features = getattr(embedding, "features", None)
    if features is None and hasattr(embedding, "tables"):
        features = [f for table in embedding.tables for f in table.features]
    if features is None:
        raise ConfigError(
            f"SparseArch cannot tell which fields a {type(embedding).__name__} serves: pass features=[...]"
        )
    return list(features)


class DenseArch(nn.Module):
    """Bottom MLP: dense features [B, Dd] to a vector [B, D] that joins the interaction.

    Without dense features (Dd = 0, e.g. MovieLens) the vector is a learned constant.
    """

    def __init__(self, num_dense: int, layer_sizes: list[int]) -> None:
        super().__init__()
        self.model = mlp(num_dense, layer_sizes, final_activation=True) if num_dense > 0 else None
        self.constant = None if num_dense > 0 else nn.Parameter(torch.zeros(layer_sizes[-1]))

    def forward(self, dense: Tensor) -> Tensor:
        if self.model is None:
            return self.constant.expand(dense.shape[0], -1)
        return self.model(dense)


class InteractionArch(nn.Module):
    """DLRM dot interaction of the dense vector with the pooled embeddings.

    Args:
        num_sparse: F.
        dim: D.
        backend: ``auto`` | ``reference`` | ``triton`` (see :mod:`recaccel.ops.interaction`).
        pad: Zero-pad each output row to a multiple of 8 elements; ``output_dim`` stays the
            unpadded width, so only a consumer that takes padded input (an aligned MLP
            whose padding columns meet zero weights) may turn this on.
    """

    def __init__(self, num_sparse: int, dim: int, backend: str = "auto", pad: bool = False) -> None:
        super().__init__()
        self.num_sparse = num_sparse
        self.dim = dim
        self.backend = backend
        self.pad = pad

    @property
    def output_dim(self) -> int:
        """The unpadded width D + (F+1)F/2: the in-features of the top MLP's first layer."""
        return interaction_output_dim(self.num_sparse, self.dim)

    @property
    def output_width(self) -> int:
        """Columns :meth:`forward` returns: :attr:`output_dim`, rounded up to a multiple of 8 with ``pad``."""
        return interaction_output_dim(self.num_sparse, self.dim, pad=self.pad)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Maps dense [B, D] and pooled [B, F, D] to [B, D + (F+1)F/2] (padded if ``pad``)."""
        # Row 0 is the dense vector, rows 1..F the pooled embeddings, read in place (no cat).
        device_type = dense.device.type
        dtype = torch.promote_types(dense.dtype, pooled.dtype)
        if torch.is_autocast_enabled(device_type):
            # Mixed precision: the interaction runs in the autocast dtype on every backend
            # (a custom kernel is not autocast by itself).
            dtype = torch.get_autocast_dtype(device_type)
        return dot_interaction_pair(dense.to(dtype), pooled.to(dtype), self.backend, pad=self.pad)

    def extra_repr(self) -> str:
        return f"num_sparse={self.num_sparse}, dim={self.dim}, backend={self.backend!r}, pad={self.pad}"


class DCNv2InteractionArch(nn.Module):
    """DCN-v2 interaction (TorchRec's DLRM_DCN): L low-rank cross layers over the
    concatenation ``x0`` = [dense vector, flattened pooled embeddings], [B, K = D + F*D]::

        x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l

    Its output x_L [B, K] feeds the over arch. U and V start Glorot-normal, b at zero.

    Args:
        num_sparse: F.
        dim: D.
        num_layers: L (``model.dcn_layers``).
        rank: r (``model.dcn_rank``).
        backend: ``auto`` | ``reference`` | ``triton`` (see :func:`recaccel.ops.interaction.dcnv2_cross`).
        kernel: what ``triton`` runs (``model.dcn_kernel``): ``gemm`` (library GEMMs and one
            fused elementwise kernel per layer) or ``fused`` (every layer in one launch).

    Attributes:
        u: [L, K, r]. v: [L, r, K]. b: [L, K].
    """

    def __init__(
        self,
        num_sparse: int,
        dim: int,
        num_layers: int,
        rank: int,
        backend: str = "auto",
        kernel: str = "gemm",
    ) -> None:
        super().__init__()
        if kernel not in CROSS_KERNELS:
            raise ConfigError(f"model.dcn_kernel must be one of {', '.join(CROSS_KERNELS)}, got {kernel!r}")
        self.num_sparse = num_sparse
        self.dim = dim
        self.backend = backend
        self.kernel = kernel
        u, v, b = init_cross_weights(self.output_dim, num_layers, rank)
        self.u = nn.Parameter(u)
        self.v = nn.Parameter(v)
        self.b = nn.Parameter(b)

    @property
    def output_dim(self) -> int:
        """K = D + F*D."""
        return self.dim * (self.num_sparse + 1)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Maps dense [B, D] and pooled [B, F, D] to x_L [B, D + F*D]."""
        x0 = torch.cat([dense, pooled.flatten(1)], dim=1)
        u, v, b = self.u, self.v, self.b
        device_type = x0.device.type
        if torch.is_autocast_enabled(device_type):
            # Mixed precision: the cross layers run in the autocast dtype on every backend.
            dtype = torch.get_autocast_dtype(device_type)
            x0, u, v, b = x0.to(dtype), u.to(dtype), v.to(dtype), b.to(dtype)
        else:
            u, v, b = u.to(x0.dtype), v.to(x0.dtype), b.to(x0.dtype)
        return dcnv2_cross(x0, u, v, b, backend=self.backend, kernel=self.kernel)

    def extra_repr(self) -> str:
        layers, k, rank = self.u.shape
        return (
            f"in_features={k}, layers={layers}, rank={rank}, backend={self.backend!r}, kernel={self.kernel!r}"
        )


class OverArch(nn.Module):
    """Top MLP ending in one logit per row.

    Args:
        in_features: K, the unpadded input width (the first layer's weight is [.., K]).
        layer_sizes: the layers' widths, ending in 1.
        padded_input: the input may arrive zero-padded to a multiple of 8 columns (a
            padded :class:`InteractionArch`). The MLP then runs aligned on every device
            (:attr:`MLP.align`): the padding meets zero weight columns made at run time,
            so the parameters, state_dict and output are those of an unpadded arch.
    """

    def __init__(self, in_features: int, layer_sizes: list[int], *, padded_input: bool = False) -> None:
        super().__init__()
        if not layer_sizes or layer_sizes[-1] != 1:
            raise ValueError(f"top MLP must end in one unit (a logit), got {layer_sizes}")
        self.model = mlp(in_features, layer_sizes, final_activation=False)
        self.padded_input = padded_input
        if padded_input:
            self.model.align = True

    def extra_repr(self) -> str:
        return f"padded_input={self.padded_input}"

    def forward(self, features: Tensor) -> Tensor:
        """Returns logits [B]."""
        device_type = features.device.type
        if not torch.is_autocast_enabled(device_type):
            return self.model(features).squeeze(-1)
        # Mixed precision: the hidden layers in the autocast dtype, the logit layer in
        # float32 (bfloat16 logits would tie many rows: 8 significant bits).
        hidden = self.model.run(features, stop=-1)
        with torch.autocast(device_type, enabled=False):
            return self.model.run(hidden.float(), start=-1).squeeze(-1)
