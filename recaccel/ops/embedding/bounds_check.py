"""The eager bounds check of a batch's ids and offsets (one host synchronization).

:class:`~recaccel.ops.embedding.module.PackedEmbeddingBag` runs it in ``prepare`` with
``bounds_check=True``, and again for the message when the deferred check counted bad ids.
"""

from __future__ import annotations

import torch

from recaccel.ops.embedding.packing import PackingPlan, Routing
from recaccel.ops.embedding.specs import InvalidIdError
from recaccel.sparse import SparseFeatures


def check_batch(sf: SparseFeatures, routing: Routing, plan: PackingPlan) -> None:
    """Validates a batch's CSR and ids with one host synchronization.

    Raises:
        InvalidIdError: offsets that do not start at 0, end at ``len(values)`` and never
            decrease; or an id < 0 or >= its feature's table size (naming the feature,
            its table, the id and the batch row).
    """
    values, offsets = sf.values, sf.offsets
    n, f = values.numel(), len(routing.keys)
    b = sf.batch_size
    diffs = offsets[1:] - offsets[:-1]
    bad_offsets = (offsets[0] != 0) | (offsets[-1] != n) | (diffs < 0).any()
    if b == 0 or n == 0:
        bad_ids = torch.zeros((), dtype=torch.bool, device=values.device)
        id_feat = None
    else:
        # id_feat[i] = number of features 1..F-1 starting at or before id i: a count, not a
        # search, so it is linear and stays in [0, F-1] even if the offsets are malformed.
        feat_start = offsets[b : f * b : b].clamp(0, n).long()
        marks = torch.zeros(n + 1, dtype=torch.int64, device=values.device)
        marks.index_add_(0, feat_start, torch.ones_like(feat_start))
        id_feat = marks[:n].cumsum(0)
        bad_mask = (values < 0) | (values >= routing.num_rows.index_select(0, id_feat))
        bad_ids = bad_mask.any()
    if not bool(bad_offsets | bad_ids):
        return
    if bool(bad_offsets):
        raise InvalidIdError(
            f"malformed sparse offsets for features {list(routing.keys)}: they must start at 0, never "
            f"decrease and end at len(values)={n}; got first={int(offsets[0])}, last={int(offsets[-1])}"
        )
    i = int(torch.nonzero(bad_mask)[0, 0])
    feat = int(id_feat[i])
    bag = int(torch.searchsorted(offsets, torch.tensor(i, device=offsets.device), right=True)) - 1
    name = routing.keys[feat]
    table = plan.slots[name].table
    raise InvalidIdError(
        f"feature {name!r}: id {int(values[i])} at batch row {bag - feat * b} is out of range "
        f"[0, {table.num_rows}) of table {table.name!r}",
        column=name,
    )
