"""Task-grouped files: the claim a grouped dataset's schema records, and the row order.

A dataset is *grouped* when its rows are sorted by task key (then timestamp), so the
task reader finds each task's rows contiguously. Writers of grouped files (the
group-by-task rewrite, the MovieLens and MeLU converters) record it in the schema
stored in every file: ``task_key`` (and ``timestamp``) set, and
``extra["grouped"] = {"task_key": ..., "timestamp": ...}``. Readers still verify the
order (:mod:`recaccel.io.readers.tasks.stream`); the claim only words the error.

A string task key (a ``[data.schema]`` task key column of strings) becomes an int64
task id by the project's string hash taken to 63 bits (:func:`task_id`); the claim then
records ``"key_hash": "string63"`` so a user can find a task's id from its key.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from recaccel.io.format.id_hash import string_bucket
from recaccel.io.format.schema import FeatureSchema

__all__ = ["GROUPED_KEY", "TASK_ID_BUCKETS", "grouped_claim", "grouped_schema", "task_id", "task_order"]

GROUPED_KEY = "grouped"  # the key of the claim in FeatureSchema.extra (persisted)
# String task keys hash into [0, 2**63): every id a non-negative int64, collisions
# between a million tasks about 1e-7 likely.
TASK_ID_BUCKETS = 2**63


def grouped_claim(schema: FeatureSchema) -> dict | None:
    """``{"task_key": ..., "timestamp": ...}`` if the schema says its files are grouped."""
    claim = schema.extra.get(GROUPED_KEY) if isinstance(schema.extra, dict) else None
    if isinstance(claim, dict) and claim.get("task_key") == schema.task_key and schema.task_key:
        return claim
    return None


def task_id(key: str | bytes | int) -> int:
    """The int64 task id a task key is grouped under: an integer key itself, a string
    (UTF-8) or bytes key its 63-bit string hash (:mod:`recaccel.io.format.id_hash`)."""
    if isinstance(key, int):
        return key
    return string_bucket(key, TASK_ID_BUCKETS)


def grouped_schema(
    schema: FeatureSchema, task_key: str, timestamp: str | None, key_hash: str | None = None
) -> FeatureSchema:
    """``schema`` with ``task_key``/``timestamp`` set and the grouped claim recorded;
    ``key_hash="string63"`` says the ids are :func:`task_id` hashes of string keys."""
    extra = dict(schema.extra) if isinstance(schema.extra, dict) else {}
    extra[GROUPED_KEY] = {"task_key": task_key, "timestamp": timestamp}
    if key_hash is not None:
        extra[GROUPED_KEY]["key_hash"] = key_hash
    return dataclasses.replace(schema, task_key=task_key, timestamp=timestamp, extra=extra)


def task_order(keys: np.ndarray, times: np.ndarray | None) -> np.ndarray:
    """Stable sort order of rows by task key (int64 [n]), then timestamp (int64 [n] or
    None: rows of a task keep their order): int64 [n]."""
    if times is None:
        return np.argsort(keys, kind="stable")
    return np.lexsort((times, keys))
