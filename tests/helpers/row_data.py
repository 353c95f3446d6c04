"""Small row datasets for the reader tests: schema, seeded columns, a multi-file dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet


def make_schema(num_dense: int, multi_hot: list[bool], cards: list[int]) -> FeatureSchema:
    sparse = tuple(SparseField(f"s{i}", c, m) for i, (m, c) in enumerate(zip(multi_hot, cards)))
    return FeatureSchema(dense=tuple(f"d{i}" for i in range(num_dense)), sparse=sparse)


def make_columns(schema: FeatureSchema, n: int, seed: int, style: int = 0) -> dict:
    """Random valid rows; ``style`` varies the multi-hot input convention."""
    rng = np.random.default_rng(seed)
    cols: dict = {schema.label: rng.integers(0, 2, n).astype(np.float32)}
    for name in schema.dense:
        cols[name] = rng.normal(size=n) * 100
    for f in schema.sparse:
        if not f.multi_hot:
            cols[f.name] = rng.integers(0, f.cardinality, n)
            continue
        lengths = rng.integers(0, 4, n)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        values = rng.integers(0, f.cardinality, int(offsets[-1]))
        if style % 3 == 0:
            cols[f.name] = (values, offsets)
        elif style % 3 == 1:
            cols[f.name] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))
        else:
            cols[f.name] = [values[offsets[i] : offsets[i + 1]].tolist() for i in range(n)]
    return cols


def small_dataset(tmp: Path, n: int = 300, rg: int = 25, per_file: int | None = 120, seed: int = 0):
    schema = make_schema(2, [False, True, False], [50, 20, 7])
    write_parquet(tmp, schema, make_columns(schema, n, seed), rows_per_row_group=rg, rows_per_file=per_file)
    return schema


def skipping_dataset(path: Path) -> Path:
    """300 rows in 3 files of 25-row groups with a multi-hot field, 23 of them with an id
    past its table: under ``invalid_ids = "skip"`` row groups keep fewer rows than their
    footers say (so the rows carried between shuffle buffers shift)."""
    schema = make_schema(2, [False, True, False], [50, 20, 7])
    cols = make_columns(schema, 300, 1)
    bad = np.random.default_rng(2).choice(300, 23, replace=False)
    cols[schema.sparse[0].name][bad] = 999
    write_parquet(path, schema, cols, rows_per_row_group=25, rows_per_file=120)
    return path
