"""Task-grouped files: the claim a grouped dataset's schema records, and the row order.

A dataset is *grouped* when its rows are sorted by task key (then timestamp), so the
task reader finds each task's rows contiguously. Writers of grouped files (the
group-by-task rewrite, the MovieLens and MeLU converters) record it in the schema
stored in every file: ``task_key`` (and ``timestamp``) set, and
``extra["grouped"] = {"task_key": ..., "timestamp": ...}``. Readers still verify the
order (:mod:`recaccel.io.readers.tasks.stream`); the claim only words the error.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from recaccel.io.format.schema import FeatureSchema

__all__ = ["GROUPED_KEY", "grouped_claim", "grouped_schema", "task_order"]

GROUPED_KEY = "grouped"  # the key of the claim in FeatureSchema.extra (persisted)


def grouped_claim(schema: FeatureSchema) -> dict | None:
    """``{"task_key": ..., "timestamp": ...}`` if the schema says its files are grouped."""
    claim = schema.extra.get(GROUPED_KEY) if isinstance(schema.extra, dict) else None
    if isinstance(claim, dict) and claim.get("task_key") == schema.task_key and schema.task_key:
        return claim
    return None


def grouped_schema(schema: FeatureSchema, task_key: str, timestamp: str | None) -> FeatureSchema:
    """``schema`` with ``task_key``/``timestamp`` set and the grouped claim recorded."""
    extra = dict(schema.extra) if isinstance(schema.extra, dict) else {}
    extra[GROUPED_KEY] = {"task_key": task_key, "timestamp": timestamp}
    return dataclasses.replace(schema, task_key=task_key, timestamp=timestamp, extra=extra)


def task_order(keys: np.ndarray, times: np.ndarray | None) -> np.ndarray:
    """Stable sort order of rows by task key (int64 [n]), then timestamp (int64 [n] or
    None: rows of a task keep their order): int64 [n]."""
    if times is None:
        return np.argsort(keys, kind="stable")
    return np.lexsort((times, keys))
