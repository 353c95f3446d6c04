"""Looking at reader worker processes and their shared memory from a test."""

from __future__ import annotations

import gc
import glob
import multiprocessing as mp
import os
import time
from pathlib import Path

from recaccel.io.readers import BatchReader, ReadOptions, TaskReader
from tests.helpers.task_data import tasks_config


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], seconds: float = 10) -> bool:
    """Whether every process of ``pids`` is gone within ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def wait_reaped(pids: list[int], seconds: float = 10) -> bool:
    """Whether every process of ``pids`` is reaped (no /proc entry) within ``seconds``. A
    zombie leader is not enough where the others' pipes must read EOF: the threads of a
    multi-threaded process (Arrow's) may still be exiting, holding its file table open."""
    deadline = time.monotonic() + seconds
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


def reader_workers() -> list[int]:
    """This process's reader worker processes."""
    return [p.pid for p in mp.active_children() if p.name.startswith("reader-worker")]


def our_segments() -> list[str]:
    """This process's reader segments, once readers left to the cyclic garbage collector
    (whose idle workers keep theirs) are collected."""
    gc.collect()
    return glob.glob(f"/dev/shm/rca{os.getpid()}x*")


def rows_reader(path: Path, workers: int) -> BatchReader:
    """The worker tests' shuffled row reader: batches of 16, buffers of 40 rows."""
    return BatchReader(path, 16, ReadOptions(seed=3, workers=workers), shuffle_buffer_rows=40)


def task_reader(path: Path, workers: int) -> TaskReader:
    """The worker tests' task reader: one row group per unit."""
    return TaskReader(path, tasks_config(unit_row_groups=1), ReadOptions(seed=4, workers=workers))
