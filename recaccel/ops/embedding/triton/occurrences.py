"""A pack's occurrences in row-sorted order for the Triton fused update, made once per batch.

:func:`sort_occurrences` gathers what the backward kernels walk (the sorted rows are the
sort's own keys; bags and scales gathered by the sort's order; the pieces of the
piece-lane backward) and is run by :class:`~recaccel.ops.embedding.triton.TritonPack`
right after the batch's sort, on the preparing stream, so that the backward on the main
stream starts with its kernels. :func:`usable` tells whether a preparation's pieces fit
the launch configuration the backward resolves.

Shapes: N_p occurrences of the pack.
"""

from __future__ import annotations

from recaccel.ops.embedding.packing import PackIds
from recaccel.ops.embedding.prepared import SortedOccurrences
from recaccel.ops.embedding.row_groups import RowGroups
from recaccel.ops.embedding.triton.backward_config import BackwardConfig
from recaccel.ops.embedding.triton.piece_lanes import LaneConfig
from recaccel.ops.embedding.triton.pieces import Pieces, build_pieces


def sort_occurrences(ids: PackIds, groups: RowGroups, piece_len: int | None) -> SortedOccurrences:
    """The occurrences of ``ids`` in ``groups``' order, cut into pieces of ``piece_len``
    (none when None or when the pack has no occurrence).

    Args:
        ids: The pack's ids, with ``bags``.
        groups: Their grouping by row (its sort: ``order`` and ``sorted_rows``).
        piece_len: The piece-lane backward's piece length, or None (occurrence tiles).
    """
    order = groups.order
    bags = ids.bags.index_select(0, order)
    scale = None if ids.scale is None else ids.scale.index_select(0, order)
    keys = groups.sorted_rows
    if piece_len is None or keys.numel() == 0:
        return SortedOccurrences(keys, bags, scale)
    pieces = build_pieces(keys, piece_len)
    return SortedOccurrences(keys, bags, scale, piece_len, pieces.start, pieces.count)


def piece_len_of(config: BackwardConfig) -> int | None:
    """The piece length a launch configuration needs: a :class:`LaneConfig`'s, else None."""
    return config.piece_len if isinstance(config, LaneConfig) else None


def usable(occurrences: SortedOccurrences | None, config: BackwardConfig) -> bool:
    """Whether ``occurrences`` (a preparation's) fit ``config``: same pieces, or none needed."""
    return occurrences is not None and occurrences.piece_len == piece_len_of(config)


def pieces_of(occurrences: SortedOccurrences) -> Pieces | None:
    """Its pieces as the lane launcher takes them, or None."""
    if occurrences.piece_start is None:
        return None
    return Pieces(occurrences.piece_start, occurrences.num_pieces)
