"""The meta-IO task reader and its parts: stream (whole tasks out of sorted row groups),
split (support / query), units (loading runs of row groups on threads), pool (tasks to
TaskBatches)."""

from recaccel.io.readers.tasks.pool import TaskPool, build_task_batch
from recaccel.io.readers.tasks.reader import TaskReader
from recaccel.io.readers.tasks.split import SplitSpec, split_tasks

__all__ = ["SplitSpec", "TaskPool", "TaskReader", "build_task_batch", "split_tasks"]
