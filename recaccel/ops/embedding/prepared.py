"""A batch with its embedding-lookup input preparation: what a pipeline makes ahead of time.

:meth:`PackedEmbeddingBag.prepare <recaccel.ops.embedding.PackedEmbeddingBag.prepare>`
does everything a lookup does before its kernels (validation, routing, the bounds check,
each pack's ids and, for training, the sort of the backward) and returns a
:class:`PreparedSparse`: the batch itself plus that work. Run on a side stream while the
previous batch trains, whatever synchronizes with the host no longer drains the main
stream; the lookup, its backward and
:meth:`~recaccel.ops.embedding.PackedEmbeddingBag.apply_gradient` then reuse it.

Host synchronizations: none with the deferred bounds check when the batch's features
all go to one pack (the Triton fused training step, any evaluation lookup, the
reference's lookups and autograd-mode training); one per batch whose features are split
among packs, which reads every pack's id count at once (never for a Triton evaluation,
which reads the batch's CSR); the eager check's one; and the unique rows of a backward
that needs them (the reference's fused update, Triton's autograd mode).

Memory: a preparation keeps, per pack p with N_p ids of a batch of B rows and S
features, up to N_p*(8 + 8 + 4 + 8) bytes (rows, bags, scale, sort order; rows and
offsets alias the batch's own tensors when a pack takes the batch as is) plus
(S*B + 1)*8 for its offsets and 16 per unique row, alive from :meth:`prepare` until the
backward (or ``apply_gradient``) has run and the batch is dropped: at most about 44
bytes per id for training, 12 (rows and scale) for the reference backend's evaluation,
nothing for the Triton backend's evaluation (its forward reads the batch's CSR) and for
FBGEMM. A fused Triton pack adds its occurrences in sorted order (:class:`SortedOccurrences`:
bags 8, scale 4 and, for the piece-lane backward, piece starts 8 bytes per id; the keys
are the sort's own), made right after the sort: up to about 64 bytes per id in all. The Triton backward used to recompute the ids from the CSR instead, to spare
that memory between the passes; a pipeline trades it for a backward with no id work.
With int32 ids and offsets (kept as given: see :class:`PackBatch`), rows and offsets
take 4 bytes instead of 8.

Shapes: B batch, S features of a pack, N_p ids of a pack, U unique rows.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from recaccel.ops.embedding.packing import LocalFeatures, PackIds, PackRoute, Routing, gather_pack_ids
from recaccel.ops.embedding.row_groups import AfterSort, PackSort, RowGroups, group_by_row
from recaccel.sparse import SparseFeatures


@dataclasses.dataclass(frozen=True)
class SortedOccurrences:
    """A pack's occurrences in row-sorted order, as a backward that walks them reads them
    (the Triton fused update), made right after the sort on the preparing stream.

    Attributes:
        keys: int32 or int64 [N_p] the rows in sorted order (the sort's keys).
        bags: int64 [N_p] the bag of each sorted occurrence.
        scale: float32 [N_p] its scale (id weight, ``1/L`` for mean), or None.
        piece_len: The pieces' length (the piece-lane backward's), or None without pieces.
        piece_start: int64 [N_p+1] where each piece starts (``N_p`` past the last), or None.
        num_pieces: int64 [1] the number of pieces, on the device, or None.
    """

    keys: Tensor
    bags: Tensor
    scale: Tensor | None = None
    piece_len: int | None = None
    piece_start: Tensor | None = None
    num_pieces: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        """Its tensors."""
        return [
            t for t in (self.keys, self.bags, self.scale, self.piece_start, self.num_pieces) if t is not None
        ]


@dataclasses.dataclass
class PreparedPack:
    """One pack's part of a batch's preparation.

    Attributes:
        ids: The pack's ids (:func:`~recaccel.ops.embedding.packing.gather_pack_ids`),
            with ``bags`` where the backward needs them.
        groups: The ids grouped by packed row
            (:func:`~recaccel.ops.embedding.row_groups.group_by_row`) for the backward;
            None outside training.
        sorted: The occurrences in sorted order for a backward that reads them so, made
            once the sort has run; None where the backend needs none.
    """

    ids: PackIds
    groups: RowGroups | None = None
    sorted: SortedOccurrences | None = None

    def tensors(self) -> list[Tensor]:
        """Every tensor of the preparation made so far (what a consumer stream must mark used)."""
        ids = self.ids
        out = [t for t in (ids.rows, ids.offsets, ids.scale, ids.bags) if t is not None]
        out += [] if self.groups is None else self.groups.tensors()
        return out + ([] if self.sorted is None else self.sorted.tensors())

    def take(self, fresh: PreparedPack) -> None:
        """Replaces its contents by ``fresh``'s (a preparation made again, read in place)."""
        self.ids, self.groups, self.sorted = fresh.ids, fresh.groups, fresh.sorted


@dataclasses.dataclass(frozen=True)
class PackBatch:
    """One pack's inputs for one call of its backend: everything a
    :class:`~recaccel.ops.embedding.pack_backend.PackBackend` method reads about the batch.

    Attributes:
        sf: The batch (F features, B rows): validated, its ids and offsets int32 or int64
            (each contiguous; the two may differ), weights float32 or None; with the
            deferred bounds check, its offsets clamped into a valid CSR.
        route: The pack's route for the batch's keys (its S = F_p local features).
        batch_size: B (> 0, and the pack has a feature in the batch).
        train: For :meth:`~recaccel.ops.embedding.pack_backend.PackBackend.prepare`:
            prepare what a training step's backward needs; for a lookup: the lookup is
            part of a training step (a fused pack's backward updates its rows).
        prepared: The pack's own preparation of the batch (what ``prepare`` returned,
            made for training when ``train`` is), or None (before ``prepare``, or when
            the pack needs none).
        count_ids: For ``prepare``: the pack's number of ids when the module reads it
            for all packs at once (a batch split among packs), None for "count it".
        sort: For ``prepare``: the module's sort of all packs' row groupings, or None
            (each pack sorts its own).
    """

    sf: SparseFeatures
    route: PackRoute
    batch_size: int
    train: bool
    prepared: PreparedPack | None = None
    count_ids: Callable[[], int | None] | None = None
    sort: PackSort | None = None

    def pack_ids(self, *, with_bags: bool = False) -> PackIds:
        """The pack's ids of the batch (:func:`~recaccel.ops.embedding.packing.gather_pack_ids`)."""
        num_ids = None if self.count_ids is None else self.count_ids()
        return gather_pack_ids(self.sf, self.local, self.batch_size, with_bags=with_bags, num_ids=num_ids)

    def group(self, rows: Tensor, num_rows: int, *, unique: bool, then: AfterSort | None = None) -> RowGroups:
        """The pack's ids grouped by row (:func:`~recaccel.ops.embedding.row_groups.group_by_row`),
        queued on the module's sort of all packs when there is one; ``then`` is called with
        the grouping once it is sorted (now, or when the module's sort runs)."""
        if self.sort is not None:
            return self.sort.group(rows, num_rows, unique, then)
        groups = group_by_row(rows, num_rows, unique=unique)
        if then is not None:
            then(groups)
        return groups

    @property
    def local(self) -> LocalFeatures:
        """The pack's S local features (the reference and Triton kernels' view)."""
        return self.route.local


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class PreparedSparse(SparseFeatures):
    """A :class:`~recaccel.sparse.SparseFeatures` with one module's lookup preparation.

    Its ``keys``, ``values``, ``offsets`` and ``weights`` are the validated batch (int32
    or int64 contiguous ids and offsets, as given; float32 weights without gradient). Any SparseFeatures
    operation that builds a new batch (``slice_rows``, ``to``, a ``reorder`` that moves
    fields, ...) returns a plain SparseFeatures, which a module prepares again: a
    preparation never outlives its tensors. ``reorder`` and ``select`` to the same order
    return the batch itself, preparation included.

    Attributes:
        routing: The module's routing of ``keys``.
        packs: Per pack of the module, its :class:`PreparedPack`, or None when the pack
            has no feature in the batch, the batch is empty, or its backend needs nothing.
        owner: A weak reference to the module that prepared it.
        training: Prepared for a training step (the backward's row grouping is there).
        bad_ids: Under the module's deferred bounds check, an int32 [1] device counter of
            the batch's malformed offsets and out-of-range ids, which the lookup kernels
            add to (read later by the module: no host synchronization); else None.
        unchecked: With ``bad_ids``, the batch as given (its offsets may differ from
            ``offsets``, clamped into a valid CSR): what the module checks eagerly, for
            the error's message, when the count is non-zero.
    """

    routing: Routing
    packs: list[PreparedPack | None]
    owner: weakref.ref
    training: bool
    bad_ids: Tensor | None = None
    unchecked: SparseFeatures | None = None

    def pack_batch(self, p: int, train: bool) -> PackBatch:
        """Pack ``p``'s inputs of a lookup (or deferred update) of this batch."""
        return PackBatch(self, self.routing.packs[p], self.batch_size, train, self.packs[p])

    def tensors(self) -> list[Tensor]:
        """Every tensor the batch and its preparation hold (the routing's included)."""
        out = [t for t in (self.values, self.offsets, self.weights, self.bad_ids) if t is not None]
        if self.unchecked is not None:
            out.append(self.unchecked.offsets)
        routing = self.routing
        out += [
            t
            for t in (routing.num_rows, routing.restore, routing.restore_columns, routing.order)
            if t is not None
        ]
        for route in routing.packs:
            out += [route.local.src, route.local.row_offset, route.local.is_mean]
            out += [] if route.local.limit is None else [route.local.limit]
            out += [route.slots.src, route.slots.row_offset, route.slots.is_mean, route.slot_of_local]
        for pack in self.packs:
            if pack is not None:
                out += pack.tensors()
        return out

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks every CUDA tensor of the batch and its preparation as used by ``stream``.

        For a batch prepared on a side stream and used on ``stream``: its memory is then
        not reused before ``stream``'s work on it is done, whenever the batch is dropped
        (the caller still makes ``stream`` wait for the side stream before using it).
        CPU tensors are left alone.
        """
        for t in self.tensors():
            if t.is_cuda:
                t.record_stream(stream)

    def usable_by(self, module: Any, training: bool) -> bool:
        """Whether ``module`` can use this preparation as is: it made it, and made it for
        training if ``training`` (a training preparation also serves evaluation)."""
        return self.owner() is module and (self.training or not training)
