"""One bucketed allreduce of the replicated parameters' gradients per step.

Every rank holds the same dense parameters (MLPs, Meta-SGD rates, data-parallel
embedding tables). After backward, their gradients are copied into one flat buffer per
dtype, summed over ranks with one ``all_reduce`` per buffer, and copied back; a few
scalars (the step loss) ride along in the first buffer for free. The sum, not the mean:
each rank's loss is already its share of the global mean (see
:mod:`recaccel.train.distributed.hybrid_data`), so summed gradients are the global gradient.

Unlike DDP there is no overlap of communication with backward; in exchange the step
issues exactly one collective for all dense gradients (G-Meta's outer-step contract)
and the result is bitwise identical on every rank.

A parameter whose ``.grad`` is None on this rank is left out; every rank runs the same
code on the same parameters, so the pattern is the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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
        tail = None if extras is None else extras.detach().reshape(-1)
        return flat_collective(grads, lambda flat: dist.all_reduce(flat, group=self.group), tail)


def flat_collective(
    tensors: list[Tensor], collective: Callable[[Tensor], object], tail: Tensor | None = None
) -> Tensor | None:
    """Runs ``collective`` in place on one flat buffer per dtype of ``tensors`` and
    copies the results back into them (one collective per dtype, not per tensor).

    Args:
        tensors: the tensors, updated in place.
        collective: an in-place collective on a 1-D tensor (``all_reduce``, ``broadcast``).
        tail: a 1-D tensor that rides at the end of the first buffer (cast to its dtype).

    Returns:
        ``tail`` after the collective (None when not given).
    """
    buckets: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault(t.dtype, []).append(t)
    if tail is not None:
        buckets.setdefault(next(iter(buckets), tail.dtype), [])
    result = None
    with torch.no_grad():
        for i, members in enumerate(buckets.values()):
            parts = [t.detach().reshape(-1) for t in members]
            if i == 0 and tail is not None:
                dtype = members[0].dtype if members else tail.dtype
                device = members[0].device if members else tail.device
                parts.append(tail.to(device=device, dtype=dtype))
            flat = torch.cat(parts)
            collective(flat)
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            if i == 0 and tail is not None:
                result = flat[offset:]
    return result
