"""One bucketed allreduce of the replicated parameters' gradients per step.

Every rank holds the same dense parameters (MLPs, Meta-SGD rates, data-parallel
embedding tables). After backward, their gradients are copied into one flat buffer per
dtype, summed over ranks with one ``all_reduce`` per buffer, and copied back; a few
scalars (the step loss) ride along in the first buffer for free. The sum, not the mean:
each rank's loss is already its share of the global mean (see
:mod:`recaccel.train.hybrid_data`), so summed gradients are the global gradient.

Unlike DDP there is no overlap of communication with backward; in exchange the step
issues exactly one collective for all dense gradients (G-Meta's outer-step contract)
and the result is bitwise identical on every rank.

A parameter whose ``.grad`` is None on this rank is left out; every rank runs the same
code on the same parameters, so the pattern is the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor


class DenseGradSync:
    """Sums gradients of replicated parameters over the ranks of ``group``.

    Args:
        params: the parameters whose gradients are summed (duplicates are ignored).
        group: the process group (default: the world).
    """

    def __init__(self, params: Iterable[Tensor], group: dist.ProcessGroup | None = None) -> None:
        seen: set[int] = set()
        self.params: list[Tensor] = []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.group = group

    def allreduce(self, extras: Tensor | None = None) -> Tensor | None:
        """Sums every present gradient (and ``extras``) over ranks, in place.

        Args:
            extras: a 1-D tensor of scalars to sum along (e.g. the step's loss share).

        Returns:
            ``extras`` summed over ranks (None when not given).
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        if any(g.is_sparse for g in grads):
            raise ValueError("DenseGradSync sums dense gradients; a parameter has a sparse gradient")
        buckets: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            buckets.setdefault(g.dtype, []).append(g)
        if extras is not None:
            extras = extras.detach().reshape(-1)
            first = next(iter(buckets), extras.dtype)
            buckets.setdefault(first, [])
            extras = extras.to(first)
        reduced_extras = None
        for i, (dtype, members) in enumerate(buckets.items()):
            parts = [g.reshape(-1) for g in members]
            if i == 0 and extras is not None:
                parts.append(extras.to(members[0].device) if members else extras)
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in members:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if i == 0 and extras is not None:
                reduced_extras = flat[offset:]
        return reduced_extras
