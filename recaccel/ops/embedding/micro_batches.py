"""Micro-batch plumbing of a prepared batch: the lookup of a slice of its rows, and the
sparse update of the whole batch from its pooled output's gradient (what the fused
backward does, run once per step outside autograd).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recaccel.ops.embedding.lookup_out import as_out_dtype
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
        [hi-lo, F, D] in ``sf.keys`` order, float32 or ``out_dtype`` (16 bits written by
        the packs whose kernels write them, cast for the others).

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
            outs.append(torch.zeros(hi - lo, route.local.count, plan.packs[p].dim, device=sf.values.device))
            continue
        kw = (
            {"out_dtype": out_dtype}
            if out_dtype is not None and getattr(packs[p], "writes_out", False)
            else {}
        )
        outs.append(packs[p].lookup_rows(held(p), sf.pack_batch(p, train=False), lo, hi, **kw))
    return as_out_dtype(routing.to_batch_order(outs), out_dtype)


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
        part = grad.narrow(1, starts[p], count)
        if part.dtype != torch.float32 and not getattr(packs[p], "writes_out", False):
            part = part.float()  # a 16-bit pooled gradient: only the Triton update reads it as it is
        packs[p].apply_gradient(held(p), sf.pack_batch(p, train=True), part)
