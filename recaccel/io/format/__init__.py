"""The data format: what a recaccel dataset is on disk and how a row group decodes.

:mod:`~recaccel.io.format.schema` (the feature schema stored in every Parquet file),
:mod:`~recaccel.io.format.writer` (streaming writer), :mod:`~recaccel.io.format.dataset`
(file listing, footers, row-group reading), :mod:`~recaccel.io.format.decode` (one row
group to :class:`Columns` under the bad-input :class:`Policies`),
:mod:`~recaccel.io.format.columns` (decoded rows, CSR helpers) and
:mod:`~recaccel.io.format.grouping` (the task-grouped claim and order). It imports
nothing else from :mod:`recaccel.io`; readers and converters build on it.

Names resolve on first use, so ``import recaccel.io.format.schema`` (or the writer)
does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recaccel.lazy import lazy_exports

if TYPE_CHECKING:
    from recaccel.io.format.columns import Columns, take_csr
    from recaccel.io.format.dataset import DatasetInfo, RowGroupReader, RowGroupRef, list_files, open_dataset
    from recaccel.io.format.decode import DECODE_COUNTERS, Policies, Projection, row_group_to_columns
    from recaccel.io.format.grouping import GROUPED_KEY, grouped_claim, grouped_schema, task_order
    from recaccel.io.format.schema import SCHEMA_METADATA_KEY, FeatureSchema, SparseField
    from recaccel.io.format.writer import DatasetWriter, write_parquet

# Each public name and the submodule defining it (imported on first use).
_EXPORTS = {
    "FeatureSchema": "schema",
    "SparseField": "schema",
    "SCHEMA_METADATA_KEY": "schema",
    "DatasetWriter": "writer",
    "write_parquet": "writer",
    "DatasetInfo": "dataset",
    "RowGroupRef": "dataset",
    "RowGroupReader": "dataset",
    "list_files": "dataset",
    "open_dataset": "dataset",
    "DECODE_COUNTERS": "decode",
    "Policies": "decode",
    "Projection": "decode",
    "row_group_to_columns": "decode",
    "Columns": "columns",
    "take_csr": "columns",
    "GROUPED_KEY": "grouping",
    "grouped_claim": "grouping",
    "grouped_schema": "grouping",
    "task_order": "grouping",
}

__all__ = [
    "DECODE_COUNTERS",
    "GROUPED_KEY",
    "SCHEMA_METADATA_KEY",
    "Columns",
    "DatasetInfo",
    "DatasetWriter",
    "FeatureSchema",
    "Policies",
    "Projection",
    "RowGroupReader",
    "RowGroupRef",
    "SparseField",
    "grouped_claim",
    "grouped_schema",
    "list_files",
    "open_dataset",
    "row_group_to_columns",
    "take_csr",
    "task_order",
    "write_parquet",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
