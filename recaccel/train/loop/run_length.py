"""How many steps a run of ``train.epochs`` epochs takes: the learning-rate schedule's
length and the progress bar's total.

A reader whose batch count changes with the epoch (several ranks reading shuffled
shards: each epoch deals them other row groups or task units) says so through
``batches_in_epoch(e)``, counted without reading the data; the run's length sums those
counts instead of multiplying the first epoch's. A hybrid epoch ends when the first rank
runs dry, so each epoch counts the rank with fewest batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recaccel.io.readers.protocol import Reader


def epoch_batches(reader: Reader, epochs: int) -> list[int] | None:
    """This rank's batches in each of ``epochs`` epochs, or None when not known ahead.

    Exact for readers with ``batches_in_epoch`` (the row and task readers); other readers
    (global batches sliced per rank, shards handed out while running) repeat their
    ``num_batches``, the same every epoch.
    """
    exact = getattr(reader, "batches_in_epoch", None)
    if exact is not None:
        return [int(exact(e)) for e in range(epochs)]
    per_epoch = reader.num_batches
    return [per_epoch] * epochs if per_epoch else None


def run_steps(reader: Reader, epochs: int, gather: Callable[[Tensor], Tensor]) -> int | None:
    """Steps of an ``epochs``-epoch run on every rank: per epoch the fewest batches any
    rank has, summed; None when some rank cannot tell.

    Args:
        reader: this rank's training reader.
        epochs: ``train.epochs``.
        gather: concatenates a per-rank ``[1, epochs]`` tensor over ranks (every rank
            calls it, so the ranks agree on the result).
    """
    own = epoch_batches(reader, epochs)
    row = torch.tensor([own if own is not None else [-1] * epochs], dtype=torch.int64)
    counts = gather(row)
    if epochs == 0:
        return 0
    if int(counts.min()) < 0:
        return None
    return int(counts.min(dim=0).values.sum())
