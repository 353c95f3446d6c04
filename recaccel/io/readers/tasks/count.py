"""Tasks and batches per epoch from the task key's row-group index, without decoding.

Row group ``g`` owns the tasks that start in it (see :mod:`recaccel.io.readers.tasks.stream`);
the reader keeps a task when it has at least ``min_task_rows`` rows in all, counting the
rows it has in the row groups it runs into. The :class:`~recaccel.io.readers.tasks.stream.KeyIndex`
holds, per row group, the length of its first and last runs of equal keys and how many
runs between them are large enough, which is all a walk over the row groups needs to
count the kept tasks each one owns. A rank's tasks in an epoch are those its units'
row groups own, and its batches those tasks cut T at a time (the last one short unless
``drop_last``): neither the order of units and tasks nor the split changes the count.
"""

from __future__ import annotations

import numpy as np

from recaccel.io.readers.tasks.stream import KeyIndex

__all__ = ["batch_count", "kept_tasks_owned"]


def kept_tasks_owned(index: KeyIndex) -> np.ndarray:
    """int64 [G]: tasks of at least ``index.min_rows`` rows owned by each row group."""
    kept = np.zeros(index.first.shape[0], dtype=np.int64)
    owner, size = -1, 0  # the task still open at the end of the previous row group

    def close() -> None:
        if owner >= 0 and size >= index.min_rows:
            kept[owner] += 1

    for g in range(kept.shape[0]):
        runs = int(index.runs[g])
        if owner >= 0 and index.first[g] == index.last[g - 1]:  # g's first run continues it
            size += int(index.head[g])
            if runs == 1:
                continue
            close()
        else:
            close()
            if runs > 1 and int(index.head[g]) >= index.min_rows:  # g owns its first run, closed in g
                kept[g] += 1
        kept[g] += int(index.inner_kept[g])
        owner, size = g, int(index.tail[g])  # the last run may run into later row groups
    close()
    return kept


def batch_count(tasks: int, per_batch: int, drop_last: bool) -> int:
    """Batches of ``per_batch`` tasks cut from ``tasks`` (a short last one unless ``drop_last``)."""
    return tasks // per_batch if drop_last else -(-tasks // per_batch)
