"""A batch's lookup preparation, made once for every pack of a module (see
:mod:`~recaccel.ops.embedding.prepared` for what it holds and costs).

:class:`~recaccel.ops.embedding.module.PackedEmbeddingBag` validates and routes the
batch; :func:`prepare_packs` then runs the bounds check (eager or deferred) and each
pack's own preparation, with one read of the packs' id counts and one sort of their rows.
"""

from __future__ import annotations

import functools
import weakref
from typing import Literal

import torch
from torch import Tensor

from recaccel.errors import DataError
from recaccel.ops.embedding.bounds_check import check_batch
from recaccel.ops.embedding.deferred_check import defer_batch_check
from recaccel.ops.embedding.pack_backend import PackBackend
from recaccel.ops.embedding.packing import PackIdCounts, PackingPlan, Routing
from recaccel.ops.embedding.prepared import PackBatch, PreparedSparse
from recaccel.ops.embedding.row_groups import PackSort
from recaccel.sparse import SparseFeatures

_OP = "PackedEmbeddingBag"

IdCheck = Literal["deferred", "eager", "off"]


def check_id_dtype(sf: SparseFeatures) -> None:
    """Raises DataError for a batch without features or with non-integer ids."""
    if not sf.keys:
        raise DataError(f"{_OP}: the batch has no sparse features")
    if sf.values.dtype.is_floating_point or sf.values.dtype == torch.bool:
        raise DataError(f"{_OP}: sparse ids must be integers, got {sf.values.dtype} for features {sf.keys}")


def as_kernel_input(sf: SparseFeatures) -> SparseFeatures:
    """``sf`` with what every kernel reads: flat int32 or int64 ids/offsets (every backend
    takes either; a narrower integer is widened) and float32 weights (constants: no
    gradient); ``sf`` itself when it already is. A one-hot batch's implicit offsets are
    made in its ids' dtype (:func:`one_hot_offsets`), never read."""
    values = _index_tensor(sf.values)
    weights = None if sf.weights is None else sf.weights.detach().float().contiguous()
    if sf.one_hot:
        # Never read sf.offsets (an int64 arange made on first read): the kernels' CSR is
        # made here in the ids' dtype, so int32 ids keep int32 offsets all the way; the
        # batch stays one-hot (the deferred check and the long-bag launch skip it).
        return sf.with_tensors(values, one_hot_offsets(values), weights)
    offsets = _index_tensor(sf.offsets)
    if values is sf.values and offsets is sf.offsets and weights is sf.weights:
        return sf
    return sf.with_tensors(values, offsets, weights)


def one_hot_offsets(values: Tensor) -> Tensor:
    """The offsets of a one-hot batch (one id per bag) in the dtype of its ids: int32 for
    int32 ids (when N+1 fits), else int64."""
    narrow = values.dtype == torch.int32 and values.numel() < torch.iinfo(torch.int32).max
    return torch.arange(
        values.numel() + 1, dtype=torch.int32 if narrow else torch.int64, device=values.device
    )


def _index_tensor(t: Tensor) -> Tensor:
    """``t`` contiguous, int32 or int64 as given, any other integer dtype as int64."""
    return (t if t.dtype in (torch.int32, torch.int64) else t.long()).contiguous()


def prepare_packs(
    sf: SparseFeatures,
    routing: Routing,
    packs: list[PackBackend],
    *,
    plan: PackingPlan,
    training: bool,
    check: IdCheck,
    owner: object,
) -> PreparedSparse:
    """Checks a validated, routed batch's ids and prepares each pack's input.

    Args:
        sf: The batch, validated (:func:`as_kernel_input`).
        routing: Its routing.
        packs: The module's pack backends.
        plan: The module's packing plan.
        training: Prepare what a training step's backward needs.
        check: The bounds check: ``"deferred"`` (counted on the device), ``"eager"`` (one
            host synchronization, raising now) or ``"off"``.
        owner: The module (held weakly by the result).

    Raises:
        InvalidIdError: with the eager check, an id outside its table or malformed offsets.
    """
    batch_size = sf.batch_size
    given, bad_ids = sf, None
    if check == "deferred":
        sf, bad_ids = defer_batch_check(sf)
    elif check == "eager":
        check_batch(sf, routing, plan)
    # A batch split among packs: their id counts read at most once, their row groupings
    # sorted together (one sort for every pack, bitwise the order of one per pack).
    counts, sort = PackIdCounts(sf, routing), PackSort()
    prepared = [
        None
        if route.local.count == 0 or batch_size == 0
        else packs[p].prepare(
            PackBatch(sf, route, batch_size, training, count_ids=functools.partial(counts, p), sort=sort)
        )
        for p, route in enumerate(routing.packs)
    ]
    sort.run()
    if bad_ids is not None:
        for pack in prepared:  # ids the preparation replaced by row 0 (the reference reads them)
            if pack is not None and pack.ids.bad is not None:
                bad_ids += pack.ids.bad
    return sf.with_tensors(
        sf.values,
        sf.offsets,
        sf.weights,
        PreparedSparse,
        routing=routing,
        packs=prepared,
        owner=weakref.ref(owner),
        training=training,
        bad_ids=bad_ids,
        unchecked=given if bad_ids is not None else None,
    )
