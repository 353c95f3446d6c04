"""The data side of hybrid training: each rank's slice of the global batch, and loss shares.

With ``parallel.data = "global"`` every rank reads the same stream of global batches
(the single-process reader: same files, shuffle, seed) and keeps a contiguous slice:
rank r of W takes rows ``[lo_r, hi_r)`` of each Batch (near-equal parts, the first
``B % W`` ranks one row more), or tasks ``[lo_r, hi_r)`` of each TaskBatch. Every rank
therefore sees the same number of batches, the union of the slices is exactly what one
process would train on, and resuming needs only the one shared reader position. The
price is that every rank decodes the whole global batch (a host-side cost that grows
with W; ``parallel.data = "sharded"`` reads disjoint row groups instead).

Training slices must be equal (the global batch a multiple of W): TorchRec's row-wise
backward all-gathers equal-sized gradient blocks. Evaluation slices may be uneven.

The loss of a global batch is a mean over its rows (or tasks); rank r contributes its
local mean times ``n_r / N`` (its share of the normaliser), so that summing gradients
over ranks gives the gradient of the global mean: :func:`recaccel.train.model.objectives.loss_denominator` is ``n_r``.

Shapes: B rows, F fields, T tasks, S / Q support / query rows per task.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from recaccel.config import Config
from recaccel.errors import DataError
from recaccel.io.readers.protocol import Reader
from recaccel.sparse import Batch, TaskBatch


def units(batch: Batch | TaskBatch) -> int:
    """What a batch is split over ranks by: its tasks (TaskBatch) or rows (Batch)."""
    return batch.num_tasks if isinstance(batch, TaskBatch) else batch.batch_size


def slice_units(batch: Batch | TaskBatch, lo: int, hi: int) -> Batch | TaskBatch:
    """Tasks (TaskBatch) or rows (Batch) ``[lo, hi)`` of ``batch``."""
    return batch.slice_tasks(lo, hi) if isinstance(batch, TaskBatch) else batch.slice_rows(lo, hi)


def row_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s part ``[lo, hi)`` of ``n`` items split into near-equal contiguous parts."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class GlobalSlices:
    """A reader of global batches that yields this rank's slice of each (a :class:`Reader`).

    Position, epochs and counters are the wrapped reader's (the same on every rank).

    Args:
        reader: a single-process reader (rank 0 of 1) of Batches or TaskBatches; None
            when only :meth:`local` is used.
        rank: this rank.
        world_size: W.
        train: training slices must be equal: a batch that does not split evenly raises.
        whole_tasks: yield TaskBatches whole on every rank (evaluation of meta-learning,
            where every rank then computes the same per-task metrics).

    Raises:
        DataError: while iterating, a training batch that does not split into W equal parts.
    """

    def __init__(
        self, reader: Reader | None, rank: int, world_size: int, *, train: bool, whole_tasks: bool = False
    ) -> None:
        self.reader = reader
        self.rank = rank
        self.world_size = world_size
        self.train = train
        self.whole_tasks = whole_tasks

    @property
    def epoch(self) -> int:
        return self.reader.epoch

    @property
    def counters(self) -> dict[str, int]:
        return self.reader.counters

    @property
    def num_batches(self) -> int | None:
        return self.reader.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.reader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reader.load_state_dict(state)

    def __iter__(self) -> Iterator[Batch | TaskBatch]:
        for local, _ in self.iter_with_state():
            yield local

    def iter_with_state(self) -> Iterator[tuple[Batch | TaskBatch, dict[str, Any]]]:
        """This rank's slice of each global batch, with the reader state after it."""
        for batch, state in self.reader.iter_with_state():
            yield self.local(batch), state

    def local(self, batch: Batch | TaskBatch) -> Batch | TaskBatch:
        """This rank's slice of one global batch."""
        tasks = isinstance(batch, TaskBatch)
        if tasks and self.whole_tasks:
            return batch
        n = units(batch)
        if self.train and n % self.world_size:
            unit = "tasks" if tasks else "rows"
            raise DataError(
                f"hybrid training: a batch of {n} {unit} does not split evenly over {self.world_size} ranks; "
                f"make {'tasks.tasks_per_batch' if tasks else 'data.batch_size'} a multiple of "
                f"{self.world_size} and keep data.drop_last = true"
            )
        return slice_units(batch, *row_bounds(n, self.rank, self.world_size))


def rank_reader(
    make: Callable[[int, int], Reader], cfg: Config, rank: int, world_size: int, policy: Any, *, train: bool
) -> Reader:
    """This rank's reader, from ``make(rank, world_size)`` building a plain one.

    Training with ``parallel.data = "sharded"`` reads this rank's row groups, with
    ``dynamic`` the shards rank 0's shard service hands it; under a straggler policy that
    splits global batches every rank reads them whole; otherwise every rank reads the
    global batches and keeps its slice (evaluation always: all ranks must run the same
    number of lookups).

    Args:
        make: builds a plain reader for (rank, world size).
        cfg: the run config.
        rank: this rank.
        world_size: W.
        policy: the straggler policy (its ``global_batches`` and ``ragged_batches``).
        train: the training reader (else evaluation's).
    """
    if train and cfg.parallel.data == "sharded":
        return make(rank, world_size)
    if train and cfg.parallel.data == "dynamic":
        import torch.distributed as dist

        from recaccel.train.distributed.shard_service import DynamicShardReader, ShardService

        store = dist.distributed_c10d._get_default_store()  # hosted by rank 0
        service = ShardService(store, rank, world_size, cfg.parallel.timeout_s)
        # backup: batches follow the policy's sizes, so ranks take shards as they need them.
        return DynamicShardReader(
            make(0, 1), service, cfg.data.shard_row_groups, ragged=policy.ragged_batches
        )
    if train and policy.global_batches:
        return make(0, 1)  # global batches: the policy slices them by the agreed split
    return GlobalSlices(make(0, 1), rank, world_size, train=train, whole_tasks=not train)
