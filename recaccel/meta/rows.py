"""Row-wise concatenation of sparse batches, so support and query share one lookup.

A meta step looks embeddings up once for the support rows and the query rows of all
T tasks: the two field-major CSRs are merged into one of ``Bs + Bq`` rows (support
rows first), looked up in one packed launch, and the pooled output is split back.

Shapes: F fields, Bs / Bq support / query rows, N ids, T tasks, S / Q rows per task,
D embedding dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.sparse import SparseFeatures


def concat_rows(first: SparseFeatures, second: SparseFeatures) -> SparseFeatures:
    """Stacks the rows of two batches with the same fields: rows of ``first``, then ``second``.

    Fully vectorised (no loop over fields, no host synchronisation): every id of field f
    moves by the number of ids of the other batch that now precede it.

    Args:
        first: F fields of Bs rows.
        second: the same F fields of Bq rows, in any order (matched by name).

    Returns:
        F fields of Bs + Bq rows, in ``first``'s field order. ``weights`` is None when
        neither input has weights; when only one has, the other's ids get weight 1.

    Raises:
        DataError: the two batches do not hold the same fields.
        ValueError: the tensors are on different devices.
    """
    second = second.reorder(first.keys)
    if first.values.device != second.values.device:
        raise ValueError(f"batches are on different devices: {first.values.device} vs {second.values.device}")
    num_fields = first.num_fields
    device = first.offsets.device
    if num_fields == 0:
        return SparseFeatures([], first.values[:0], torch.zeros(1, dtype=torch.int64, device=device))
    rows_a, rows_b = first.batch_size, second.batch_size
    lengths = torch.cat(
        [first.lengths().view(num_fields, rows_a), second.lengths().view(num_fields, rows_b)], dim=1
    ).reshape(-1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])

    # Start of each field's ids in each input and in the output: [F + 1].
    field_bounds = torch.arange(num_fields + 1, device=device)
    start_a = first.offsets[field_bounds * rows_a]
    start_b = second.offsets[field_bounds * rows_b]
    count_a, count_b = start_a.diff(), start_b.diff()
    start_out = start_a[:-1] + start_b[:-1]
    n_a, n_b = first.values.numel(), second.values.numel()
    field_a = torch.repeat_interleave(torch.arange(num_fields, device=device), count_a, output_size=n_a)
    field_b = torch.repeat_interleave(torch.arange(num_fields, device=device), count_b, output_size=n_b)
    pos_a = torch.arange(n_a, device=device) + (start_out - start_a[:-1])[field_a]
    pos_b = torch.arange(n_b, device=device) + (start_out + count_a - start_b[:-1])[field_b]

    values = first.values.new_empty(n_a + n_b)
    values[pos_a] = first.values
    values[pos_b] = second.values.to(values.dtype)
    weights = None
    if first.weights is not None or second.weights is not None:
        w_a = first.weights if first.weights is not None else torch.ones(n_a, device=device)
        w_b = second.weights if second.weights is not None else torch.ones(n_b, device=device)
        weights = w_a.new_empty(n_a + n_b)
        weights[pos_a] = w_a
        weights[pos_b] = w_b.to(weights.dtype)
    return SparseFeatures(list(first.keys), values, offsets, weights)


def split_task_rows(rows: Tensor, num_tasks: int, support: int, query: int) -> tuple[Tensor, Tensor]:
    """Splits rows of a support-then-query batch into task-major support and query blocks.

    Args:
        rows: [T*S + T*Q, ...] (e.g. pooled embeddings [., F, D]), support rows first.
        num_tasks: T.
        support: S rows per task.
        query: Q rows per task.

    Returns:
        Views [T, S, ...] and [T, Q, ...].

    Raises:
        ValueError: ``rows`` does not have T*(S+Q) rows.
    """
    n_s = num_tasks * support
    if rows.shape[0] != n_s + num_tasks * query:
        raise ValueError(
            f"expected {n_s} + {num_tasks * query} rows for T={num_tasks}, S={support}, Q={query}, "
            f"got {rows.shape[0]}"
        )
    tail = rows.shape[1:]
    return rows[:n_s].view(num_tasks, support, *tail), rows[n_s:].view(num_tasks, query, *tail)
