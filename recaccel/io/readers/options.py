"""How a reader reads: order, shard, bad-value policies and threads (one frozen object).

Both readers take a :class:`ReadOptions`; what each cuts (rows per batch, tasks per
batch) stays on the reader. ``ReadOptions.from_config`` maps the ``[data]`` section.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass, field
from typing import Literal

import torch.utils.data

from recaccel.config import DataConfig, UnreadableFilesPolicy
from recaccel.errors import ConfigError
from recaccel.io.format.decode import Policies


@dataclass(frozen=True)
class Shard:
    """This process's share of the data: rank ``rank`` of ``world_size``.

    Raises:
        ConfigError: unless ``0 <= rank < world_size``.
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}"
            )

    def for_worker(self, mid_epoch: bool) -> tuple[int, int]:
        """(shard, shards) this process reads: its rank's, split further among the workers
        when it runs inside a ``torch.utils.data.DataLoader`` with several workers (worker w
        of W on rank r reads shard ``r * W + w`` of ``world_size * W``).

        Raises:
            ConfigError: when resuming mid-epoch inside such workers (a saved position
                belongs to one shard, not to each worker's).
        """
        worker = torch.utils.data.get_worker_info()
        if worker is None or worker.num_workers <= 1:
            return self.rank, self.world_size
        if mid_epoch:
            raise ConfigError(
                "a reader cannot resume mid-epoch inside DataLoader workers: the saved position "
                "is one shard's; resume with num_workers <= 1 (or recaccel's DeviceLoader)"
            )
        return self.rank * worker.num_workers + worker.id, self.world_size * worker.num_workers


@dataclass(frozen=True)
class ReadOptions:
    """Read options shared by :class:`BatchReader` and :class:`TaskReader`.

    Attributes:
        shuffle: shuffle row groups (or units) and rows (or tasks) within buffers.
        seed: base seed of every shuffle (>= 0).
        drop_last: drop an epoch's last batch if it is short.
        policies: what to do with bad ids, dense values and labels.
        read_ahead: buffers (or units) decoded in advance, each on its own worker thread
            (0 = inline); batches, order and state do not depend on it.
        workers: processes decoding shuffle buffers (or units), buffer i on worker
            i % workers, handed back through shared memory; 0 = in this process
            (with ``read_ahead`` threads). Batches, order and state do not depend on it.
        shard: this process's rank and the world size.
        unreadable_files: a data folder's unreadable ``*.parquet`` entries: skipped with a
            warning (``"warn"``) or refused (``"error"``); see
            :func:`~recaccel.io.format.dataset.list_files`.

    Raises:
        ConfigError: on a negative seed, read_ahead or workers.
    """

    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    policies: Policies = field(default_factory=Policies)
    read_ahead: int = 2
    shard: Shard = field(default_factory=Shard)
    unreadable_files: UnreadableFilesPolicy = "warn"
    workers: int = 0

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if self.read_ahead < 0:
            raise ConfigError(f"read_ahead must be >= 0, got {self.read_ahead}")
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")

    @classmethod
    def from_config(
        cls, data_cfg: DataConfig, *, train: bool, shard: Shard, read_ahead: int | None = None
    ) -> ReadOptions:
        """The ``[data]`` section's options; evaluation (not ``train``) neither shuffles nor
        drops. ``read_ahead`` None = ``data_cfg.read_ahead``. ``data.workers = "auto"``
        reads in this process here: the trainer resolves it first (:func:`auto_workers`)."""
        return cls(
            shuffle=data_cfg.shuffle and train,
            seed=data_cfg.seed,
            drop_last=data_cfg.drop_last and train,
            policies=Policies.from_config(data_cfg),
            read_ahead=data_cfg.read_ahead if read_ahead is None else read_ahead,
            shard=shard,
            unreadable_files=data_cfg.unreadable_files,
            workers=0 if data_cfg.workers == "auto" else data_cfg.workers,
        )


MAX_AUTO_WORKERS = 8  # the README's GPU-host starting point: one decoding process per core pair
MIN_AUTO_BUFFERS = 4  # an epoch of fewer shuffle buffers is decoded before workers pay off


def auto_workers(
    setting: int | Literal["auto"], device_type: str, local_ranks: int = 1, buffers: int | None = None
) -> int:
    """``data.workers`` as a count: a number as it is; ``"auto"`` = 0 on a CPU device (the
    training process needs the cores, and on a small host a worker is slower than the
    training process decoding itself: bench/results/io_workers_cpu.md), inside a daemonic
    process (which cannot start any) and for data of fewer than :data:`MIN_AUTO_BUFFERS`
    shuffle buffers an epoch (``buffers``; starting processes costs more than they save),
    else half the cores shared by the ``local_ranks`` processes of the host, at most
    :data:`MAX_AUTO_WORKERS`."""
    if setting != "auto":
        return setting
    small = buffers is not None and buffers < MIN_AUTO_BUFFERS
    if device_type != "cuda" or small or mp.current_process().daemon:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(MAX_AUTO_WORKERS, cores // (2 * max(1, local_ranks))))
