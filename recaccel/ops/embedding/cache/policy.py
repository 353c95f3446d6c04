"""Victim choice of the device cache: which unlocked slots a fetch reuses, in order.

Slots locked by a batch of the window are never candidates (see
:mod:`recaccel.ops.embedding.cache.slots`). Among the candidates:

- ``lru``: least recently requested first (``last_use``, the preparation count at the
  slot's last request); ties (only empty slots share a ``last_use`` of -1) by lowest slot.
- ``lfu``: fewest requests since the row became resident first (``freq``); ties by
  least recently requested, then by lowest slot.

Empty slots (``last_use`` -1, ``freq`` 0) come first under both policies. The order is a
pure function of the slots' counters, so a run is reproducible.

Shapes: C slots, K candidates.
"""

from __future__ import annotations

import torch
from torch import Tensor


def victim_order(policy: str, candidates: Tensor, last_use: Tensor, freq: Tensor) -> Tensor:
    """The candidate slots in the order they are reused.

    Args:
        policy: ``"lru"`` or ``"lfu"``.
        candidates: bool [C] slots that may be reused.
        last_use: int64 [C] preparation count of each slot's last request (-1: empty).
        freq: int64 [C] requests of each slot's row since it became resident.

    Returns:
        int64 [K] candidate slots, first victim first.
    """
    slots = torch.nonzero(candidates).squeeze(1)  # ascending: the final tie-break
    slots = slots.index_select(0, torch.sort(last_use.index_select(0, slots), stable=True).indices)
    if policy == "lfu":
        slots = slots.index_select(0, torch.sort(freq.index_select(0, slots), stable=True).indices)
    return slots
