"""Micro-batch plumbing of a prepared batch: the lookup of a slice of its rows, and the
sparse update of the whole batch from its pooled output's gradient (what the fused
backward does, run once per step outside autograd).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recaccel.ops.embedding.pack_backend import PackBackend
from recaccel.ops.embedding.packing import PackingPlan, check_one_dim
from recaccel.ops.embedding.prepared import PreparedSparse

_OP = "PackedEmbeddingBag"

Held = Callable[[int], dict[str, Tensor]]  # pack index -> the module's tensors of that pack


def lookup_pack_rows(
    sf: PreparedSparse,
    lo: int,
    hi: int,
    packs: list[PackBackend],
    held: Held,
    plan: PackingPlan,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Pools rows ``lo .. hi-1`` of a prepared batch, pack by pack, without a graph.

    Returns:
        [hi-lo, F, D] in ``sf.keys`` order, float32 or ``out_dtype`` (each pack's kernel
        writes it, or its backend casts).

    Raises:
        ValueError: rows outside the batch, or features of different dims.
    """
    routing, batch_size = sf.routing, sf.batch_size
    if not 0 <= lo <= hi <= batch_size:
        raise ValueError(f"{_OP}.lookup_rows: rows [{lo}, {hi}) are not within the batch's {batch_size} rows")
    check_one_dim(routing, "lookup_rows")
    outs = []
    for p, route in enumerate(routing.packs):
        if route.local.count == 0 or hi == lo:
            shape, dtype = (hi - lo, route.local.count, plan.packs[p].dim), out_dtype or torch.float32
            outs.append(torch.zeros(shape, dtype=dtype, device=sf.values.device))
            continue
        outs.append(packs[p].lookup_rows(held(p), sf.pack_batch(p, train=False), lo, hi, out_dtype))
    return routing.to_batch_order(outs)


def apply_pack_gradients(sf: PreparedSparse, grad: Tensor, packs: list[PackBackend], held: Held) -> None:
    """Applies each pack's sparse update of a training-prepared batch for ``grad``, the
    [B, F, D] gradient of its pooled output (features in ``sf.keys`` order).

    Raises:
        ValueError: ``grad`` of the wrong shape, or features of different dims.
    """
    routing, batch_size = sf.routing, sf.batch_size
    check_one_dim(routing, "apply_gradient")
    want = (batch_size, len(routing.keys), routing.dims[0])
    if tuple(grad.shape) != want:
        raise ValueError(
            f"{_OP}.apply_gradient: grad has shape {tuple(grad.shape)}, expected [B, F, D] = {list(want)}"
        )
    grad = grad.detach()
    # The packs' outputs concatenated (the backward of forward's restoring gather).
    grad = grad if routing.order is None else grad.index_select(1, routing.order)
    starts = [0]
    for route in routing.packs:
        starts.append(starts[-1] + route.local.count)
    # Last pack first: the order in which autograd runs the packs' backward (its ready
    # queue takes the newest node first), hence the same rounding-seed draws.
    for p in reversed(range(len(routing.packs))):
        count = routing.packs[p].local.count
        if count == 0 or batch_size == 0:
            continue  # no lookup, hence no backward
        packs[p].apply_gradient(held(p), sf.pack_batch(p, train=True), grad.narrow(1, starts[p], count))
