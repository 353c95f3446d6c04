"""The sort key of a task-grouped rewrite: each row's task key (and timestamp), and the
columns the output is written with."""

from __future__ import annotations

import dataclasses

import numpy as np

from recaccel.errors import ConfigError
from recaccel.io.format.columns import Columns
from recaccel.io.format.grouping import grouped_schema
from recaccel.io.format.schema import FeatureSchema


def writer_columns(cols: Columns, schema: FeatureSchema, keys: np.ndarray, times: np.ndarray | None) -> dict:
    """Rows of ``cols`` as the ``columns`` mapping of :class:`DatasetWriter` for ``schema``.

    ``cols`` must hold every dense and sparse feature of ``schema`` (in schema order);
    ``keys`` / ``times`` (int64 [n]) fill the task key and timestamp columns.
    """
    out: dict = {schema.label: cols.labels}
    out.update({name: np.ascontiguousarray(cols.dense[:, j]) for j, name in enumerate(schema.dense)})
    for f, sf in enumerate(schema.sparse):
        out[sf.name] = (cols.values[f], cols.offsets[f]) if sf.multi_hot else cols.values[f]
    out[schema.task_key] = keys
    if schema.timestamp is not None:
        out[schema.timestamp] = times
    return out


class KeySource:
    """Extracts the (task key, timestamp) of decoded rows of the source."""

    def __init__(
        self,
        schema: FeatureSchema,
        task_key: str,
        timestamp: str | None,
        task_column: str | None,
        key_hash: str | None = None,
    ):
        single = {f.name: i for i, f in enumerate(schema.sparse) if not f.multi_hot}
        if task_key == schema.task_key:
            self.field = None
            out_key = task_key
        elif task_key in single:
            self.field = single[task_key]
            out_key = task_column or "task"
        else:
            valid = sorted([*single, *([schema.task_key] if schema.task_key else [])])
            raise ConfigError(
                f"task key {task_key!r} is neither the schema's task key column nor a single-hot "
                f"sparse field (valid: {valid})"
            )
        if timestamp is None:
            timestamp = schema.timestamp
        elif timestamp != schema.timestamp:
            raise ConfigError(
                f"timestamp {timestamp!r} is not the schema's timestamp column ({schema.timestamp!r})"
            )
        self.task_key = task_key
        self.timestamp = timestamp
        self.side = tuple(c for c in (schema.task_key, schema.timestamp) if c is not None)
        # source=None: a mapped source is written in recaccel's own column types.
        base = dataclasses.replace(schema, task_key=None, timestamp=None, source=None)
        taken = set(base.column_names())
        if out_key in taken:
            raise ConfigError(f"task column name {out_key!r} is already a column; pass another task_column")
        self.out_schema = grouped_schema(base, out_key, timestamp, key_hash if self.field is None else None)

    def keys(self, cols: Columns) -> tuple[np.ndarray, np.ndarray | None]:
        keys = cols.side[self.task_key] if self.field is None else cols.values[self.field]
        times = cols.side[self.timestamp] if self.timestamp is not None else None
        return keys, times
