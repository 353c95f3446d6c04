"""Task-grouped datasets for the reader tests: schema, columns, writer, batch contents, settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings

from recaccel.config import TasksConfig
from recaccel.io.format.grouping import grouped_schema
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet

TASK_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def task_schema(n: int, *, timestamp: bool = True, grouped: bool = True) -> FeatureSchema:
    sparse = (SparseField("rid", max(n, 1)), SparseField("tags", 9, multi_hot=True), SparseField("c", 5))
    base = FeatureSchema(dense=("d0",), sparse=sparse, label_kind="rating")
    if grouped:
        return grouped_schema(base, "user", "ts" if timestamp else None)
    return dataclasses.replace(base, task_key="user", timestamp="ts" if timestamp else None)


def task_columns(
    sizes: list[int], seed: int, *, timestamp: bool = True, keys: list[int] | None = None
) -> dict:
    """Rows of tasks with ``sizes`` rows each, sorted by task key (rid = row number)."""
    rng = np.random.default_rng(seed)
    n = int(sum(sizes))
    keys = (
        keys
        if keys is not None
        else sorted(rng.choice(10 * len(sizes) + 10, len(sizes), replace=False).tolist())
    )
    lengths = rng.integers(0, 3, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cols = {
        "label": rng.integers(1, 6, n).astype(np.float32),
        "d0": rng.normal(size=n).astype(np.float32),
        "rid": np.arange(n),
        "tags": (rng.integers(0, 9, int(offsets[-1])), offsets),
        "c": rng.integers(0, 5, n),
        "user": np.repeat(np.asarray(keys, dtype=np.int64), sizes),
    }
    if timestamp:
        cols["ts"] = rng.integers(0, 50, n)  # ties on purpose
    return cols


def write_tasks(
    path: Path, sizes: list[int], seed: int = 0, rg: int = 16, per_file: int | None = None, **kw
) -> dict:
    timestamp = kw.pop("timestamp", True)
    # Unaligned by default: tasks then cross row groups, as in files from other tools.
    align = kw.pop("align_tasks", False)
    cols = task_columns(sizes, seed, timestamp=timestamp, **kw)
    schema = task_schema(int(sum(sizes)), timestamp=timestamp)
    write_parquet(path, schema, cols, rows_per_row_group=rg, rows_per_file=per_file, align_tasks=align)
    return cols


def batch_tasks(tb) -> list[tuple[int, list[int], list[int]]]:
    """(task key, support rids, query rids) of every task in a TaskBatch (real rows only)."""
    t, s, q = tb.num_tasks, tb.support_size, tb.query_size
    srid = tb.support.sparse.field("rid")[0].view(t, s)
    qrid = tb.query.sparse.field("rid")[0].view(t, q)
    out = []
    for i in range(t):
        sm, qm = tb.support_mask[i] > 0, tb.query_mask[i] > 0
        out.append((int(tb.task_ids[i]), srid[i][sm].tolist(), qrid[i][qm].tolist()))
    return out


def tasks_config(**kw) -> TasksConfig:
    base = dict(tasks_per_batch=3, support_size=6, query_size=4, min_task_rows=2, shuffle_buffer_tasks=5)
    base.update(kw)
    return TasksConfig(**base)
