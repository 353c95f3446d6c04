"""Task-grouped Parquet: a dataset rewritten sorted by task key (then timestamp).

Meta-IO reads a task's rows contiguously, so the files must be sorted by task key.
:func:`group_by_task` rewrites any recaccel dataset that way with bounded memory, by
an external merge sort:

1. runs: the source is read row group by row group; every ``memory_rows`` rows are
   sorted (stable, by task key then timestamp) and spilled to a temporary Parquet run;
2. merge: the runs are merged k-way, one row group of each run in memory. Each round
   emits, from every run, the rows not greater than the smallest *last* (key, time)
   among the runs that still have unread row groups; every later row is at least that
   large, so the output stays sorted. Rows equal to that bound leave only from runs up
   to the first one ending on it, and each round sorts its block stably, so ties keep
   run order and the whole rewrite is deterministic.

When everything fits in ``memory_rows`` no run is spilled. Memory holds at most
``memory_rows`` rows (or one source row group, if larger) while making runs, and at
most ``memory_rows`` while merging: a merge reads ``fan_in`` runs at once, one row group
of ``memory_rows // (2 fan_in)`` rows each (:func:`merge_plan`); with more runs than
that, groups of runs are first merged into longer runs (several passes).

What marks a file as grouped: the claim of :mod:`recaccel.io.format.grouping` in the
output schema (stored in every file's metadata). The task reader reads the task key column of
every row group once to find task boundaries and check the order across row groups;
a file that claims to be grouped is still verified (:mod:`recaccel.io.readers.tasks.stream`).

The task key may be the schema's task key column or a single-hot sparse field (a user
id field, say): then its ids are copied into a new int64 task column (``task_column``,
default ``"task"``). A previous task key column that is not the new key is dropped.

Any Parquet file is read through a ``[data.schema]`` mapping (``schema``), the decode
path training uses (:mod:`recaccel.io.format.mapping`): string categoricals are hashed
as the mapping says, a string task key becomes its 63-bit hash
(:func:`recaccel.io.format.grouping.task_id`; the output's grouped claim records
``key_hash = "string63"``, and ``task_keys.csv`` beside the files lists each key with
its id), and the output is a recaccel dataset needing no mapping.

Modules: ``rewrite`` (the function and its report), ``merge`` (runs and the k-way
merge), ``sort_keys`` (the rows' task key and timestamp, the output columns).
"""

from recaccel.io.convert.group_by_task.merge import merge_plan
from recaccel.io.convert.group_by_task.rewrite import TASK_KEYS_FILE, GroupReport, group_by_task

__all__ = ["TASK_KEYS_FILE", "GroupReport", "group_by_task", "merge_plan"]
