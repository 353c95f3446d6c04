"""A packed lookup that writes its pooled result into a caller's buffer, or in 16 bits.

A CUDA-graphed dense head reads its input from one static buffer; a lookup that writes
there saves the head a copy of the whole [B, F, D] tensor per step. Where one pack's
output is the batch's feature order (one pack covering every feature, in order: the
common case) and its backend writes into a given tensor, the kernel writes into ``out``
directly; otherwise the result is copied into ``out`` once. Either way the returned
tensor is ``out`` itself, carrying the lookup's autograd node, so the backward (the fused
sparse update, or the rows' gradient) is the lookup's own.

A 16-bit ``out_dtype`` (a DLRM under mixed precision) has the Triton kernels pool in
float32 and store 16 bits, and their backward read the 16-bit gradient as it is: half
the pooled tensor's traffic both ways. Other backends pool in float32 and are cast.

Shapes: B batch, F features, D dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from recaccel.errors import RecaccelError
from recaccel.ops.embedding.pack_backend import PackBackend
from recaccel.ops.embedding.packing import Routing
from recaccel.ops.embedding.prepared import PackBatch, PreparedSparse

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_out(out: Tensor, shape: tuple[int, int, int], device: torch.device) -> None:
    """Raises RecaccelError (one line) naming what is wrong with a lookup's ``out``.

    Args:
        out: The caller's buffer.
        shape: [B, F, D] the lookup's result.
        device: Where the batch is.
    """
    where = "PackedEmbeddingBag.forward: out"
    if tuple(out.shape) != shape:
        raise RecaccelError(f"{where} has shape {tuple(out.shape)}, expected {shape}")
    if out.dtype not in OUT_DTYPES:
        raise RecaccelError(f"{where} has dtype {out.dtype}, expected float32, bfloat16 or float16")
    if out.device != device:
        raise RecaccelError(f"{where} is on {out.device} but the batch is on {device}")
    if out.requires_grad and out.is_leaf:
        raise RecaccelError(
            f"{where} is a leaf that requires grad (the lookup writes into it): pass a detached tensor"
        )


def direct_pack(routing: Routing) -> int | None:
    """The one pack whose output is the whole batch in its feature order, or None
    (features reordered, or spread over several packs)."""
    if routing.restore is not None:
        return None
    filled = [p for p, route in enumerate(routing.packs) if route.local.count > 0]
    return filled[0] if len(filled) == 1 else None


def pack_outs(
    sf: PreparedSparse, out: Tensor | None, packs: Sequence[PackBackend], out_dtype: torch.dtype | None = None
) -> list[Tensor | None]:
    """Per pack, the tensor its kernel writes into: ``out`` for the pack that covers the
    batch in order when its backend writes into a given tensor; with a 16-bit
    ``out_dtype`` (and no ``out``), a new [B, F_p, D_p] tensor of that dtype for each pack
    whose backend writes into one (the kernel pools in float32 and writes 16 bits: half
    the output's traffic); None for the others (whose results :func:`into_out` copies, or
    :func:`as_out_dtype` casts).

    Raises:
        RecaccelError: a bad ``out`` (:func:`check_out`) or ``out_dtype``.
    """
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise RecaccelError(
            f"PackedEmbeddingBag.forward: out_dtype {out_dtype} is not float32, bfloat16 or float16"
        )
    routing, batch_size = sf.routing, sf.batch_size
    if out is None:
        if out_dtype in (None, torch.float32):
            return [None] * len(packs)
        return [
            torch.empty(
                batch_size,
                route.local.count,
                routing.dims[route.features[0]],
                dtype=out_dtype,
                device=sf.values.device,
            )
            if getattr(pack, "writes_out", False) and route.local.count and batch_size
            else None
            for pack, route in zip(packs, routing.packs, strict=True)
        ]
    if out_dtype is not None and out_dtype != out.dtype:
        raise RecaccelError(
            f"PackedEmbeddingBag.forward: out_dtype {out_dtype} but out has dtype {out.dtype}"
        )
    dim = routing.dims[0] if routing.dims else 0
    check_out(out, (batch_size, len(routing.keys), dim), sf.values.device)
    direct = direct_pack(routing)
    if direct is not None and not (getattr(packs[direct], "writes_out", False) and out.stride(2) == 1):
        direct = None
    return [out if p == direct else None for p in range(len(packs))]


def as_out_dtype(pooled: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    """``pooled`` in ``out_dtype`` (a cast, under autograd, where a backend pooled in float32)."""
    return pooled if out_dtype is None or pooled.dtype == out_dtype else pooled.to(out_dtype)


def pack_lookup(
    pack: PackBackend, held: Mapping[str, Tensor], batch: PackBatch, out: Tensor | None
) -> Tensor:
    """``pack``'s lookup of ``batch``, written into ``out`` when given (see :func:`pack_outs`)."""
    return pack.lookup(held, batch) if out is None else pack.lookup(held, batch, out=out)


def into_out(pooled: Tensor, out: Tensor | None) -> Tensor:
    """``pooled`` where there is no ``out``, else ``out`` holding it: ``out`` itself when the
    kernel wrote there, else a copy in place, so that under grad ``out`` carries
    ``pooled``'s autograd history (a copy's backward passes the gradient on unchanged)."""
    if out is None or pooled is out:
        return pooled
    return out.copy_(pooled)
