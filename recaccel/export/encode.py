"""Raw rows to the exported program's inputs, exactly as training saw them.

An export's ``model.json`` records how every input was mapped (:func:`describe_inputs`):
each dense column's transform and statistics, and each sparse field's mapping (its ids
as they are, a hash into N buckets, or a vocabulary with its values). :func:`encode`
reads it and turns a pandas DataFrame, a pyarrow Table or a dict of lists holding the
raw columns into ``(dense, values, offsets)`` for :mod:`recaccel.export.serving`'s
program, through the same decoding code the trainer's readers run (so hashes,
vocabulary rows and transforms match bit for bit). Bad input (a missing column, a null
id, an id outside its table) is one :class:`~recaccel.errors.DataError` line naming the
column and row.

Shapes: B rows, Dd dense features, F fields, N ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from recaccel.config import Config, DenseTransform, SchemaMapping, SparseColumn
from recaccel.errors import DataError, RecaccelError
from recaccel.io.format.decode import Policies, row_group_to_columns
from recaccel.io.format.mapping import resolve_mapping
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.vocabulary import OOV_ROW, load_vocabularies

HASH_FUNCTION = "recaccel id_hash: splitmix64 of integer ids, word-wise mix64 of UTF-8 strings (unseeded)"
_ROWS = "rows"  # how messages name the input


def describe_inputs(cfg: Config, schema: FeatureSchema) -> dict[str, Any]:
    """The ``dense`` and ``fields`` entries of ``model.json``: each input's name and mapping.

    Args:
        cfg: the run's config (its ``[data.schema]``, if any, says how columns were mapped).
        schema: the feature schema the run trained on.
    """
    mapping = cfg.data.schema
    transforms = mapping.transforms if mapping is not None else {}
    dense = [_dense_entry(name, transforms.get(name)) for name in schema.dense]
    vocabularies = {}
    if (
        mapping is not None
        and mapping.vocabulary_file is not None
        and any(c.vocabulary for c in mapping.sparse.values())
    ):
        vocabularies = load_vocabularies(str(mapping.vocabulary_file), mapping.vocabulary_sha256)
    fields = []
    for f in schema.sparse:
        col = mapping.sparse[f.name] if mapping is not None else None
        entry = {"name": f.name, "cardinality": f.cardinality, "multi_hot": f.multi_hot}
        entry["mapping"] = _field_mapping(col, vocabularies.get(f.name), f.cardinality)
        fields.append(entry)
    return {"label": schema.label, "mapped": mapping is not None, "dense": dense, "fields": fields}


def _dense_entry(name: str, transform: DenseTransform | None) -> dict[str, Any]:
    t = transform or DenseTransform()
    return {"name": name, "transform": t.transform, "mean": t.mean, "std": t.std}


def _field_mapping(col: SparseColumn | None, vocabulary, rows: int) -> dict[str, Any]:
    if col is not None and vocabulary is not None and col.vocabulary:
        kept = list(vocabulary.values[: rows - 1])
        return {
            "kind": "vocabulary",
            "type": vocabulary.kind,
            "min_count": col.min_count,
            "oov_row": OOV_ROW,
            "values": kept,  # row i + 1 holds values[i]
        }
    if col is not None and col.hash:
        return {"kind": "hash", "buckets": col.hash, "function": HASH_FUNCTION}
    return {"kind": "ids", "cardinality": rows}


def encode(rows: Any, model: str | Path | dict) -> tuple[Tensor, Tensor, Tensor]:
    """The exported program's inputs for raw rows.

    Args:
        rows: a pandas DataFrame, a pyarrow Table, or a dict of equal-length lists, with
            the columns the run trained on (raw: strings, integers, floats, lists).
        model: the export's ``.json`` description, the folder holding it (one
            ``torch_export`` description), or that description already parsed.

    Returns:
        ``dense`` float32 [B, Dd], ``values`` int64 [N], ``offsets`` int64 [F*B + 1]:
        what the ``torch.export`` program takes.

    Raises:
        RecaccelError: an unreadable description; DataError naming the column (and row)
            for a missing column, a null or out-of-range id, or a wrong type.
    """
    spec = model if isinstance(model, dict) else read_spec(model)
    table = _typed_nulls(_table(rows), spec)
    schema = _schema(spec, table)
    policies = Policies(invalid_ids="error", invalid_dense="error", invalid_labels="error")
    if schema.label not in table.column_names:  # the decoder reads a label: a dummy one
        table = table.append_column(schema.label, pa.array(np.zeros(table.num_rows, dtype=np.float32)))
    cols = row_group_to_columns(table, schema, policies, _ROWS, 0)
    return _tensors(cols, table.num_rows)


def read_spec(path: str | Path) -> dict[str, Any]:
    """An export's description: ``path`` itself, or the one ``torch_export`` ``.json`` in
    the folder ``path``.

    Raises:
        RecaccelError: no such file, not JSON, no mapping recorded, or no single
            description in the folder.
    """
    path = Path(path)
    if path.is_dir():
        found = [p for p in sorted(path.glob("*.json")) if _is_serving_spec(p)]
        if len(found) != 1:
            raise RecaccelError(f"{path} holds {len(found)} torch_export descriptions (.json); name one")
        path = found[0]
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecaccelError(f"cannot read export description {path}: {' '.join(str(e).split())}") from None
    if not isinstance(spec, dict) or "fields" not in spec or not isinstance(spec.get("dense"), list):
        raise RecaccelError(
            f"{path} records no input mapping (re-export the run with this recaccel: recaccel-export)"
        )
    return spec


def _is_serving_spec(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == "torch_export"
    except (OSError, ValueError, AttributeError):
        return False


def _table(rows: Any) -> pa.Table:
    if isinstance(rows, pa.Table):
        return rows
    if isinstance(rows, dict):
        try:
            return pa.table(rows)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise DataError(
                f"rows are not a table of equal-length columns ({' '.join(str(e).split())})"
            ) from None
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas is optional
        pd = None
    if pd is not None and isinstance(rows, pd.DataFrame):
        return pa.Table.from_pandas(rows, preserve_index=False)
    raise DataError(
        f"rows must be a pandas DataFrame, a pyarrow Table or a dict of lists, got {type(rows).__name__}"
    )


def _typed_nulls(table: pa.Table, spec: dict[str, Any]) -> pa.Table:
    """Columns Arrow typed ``null`` (all values missing, or only empty lists in a dict of
    lists) given the type their field's mapping reads, so they map as training did."""
    for f in spec["fields"]:
        if f["name"] not in table.column_names:
            continue
        i = table.column_names.index(f["name"])
        typ = table.schema.field(i).type
        m = f["mapping"]
        item = pa.string() if m["kind"] == "vocabulary" and m["type"] == "string" else pa.int64()
        if pa.types.is_null(typ):
            table = table.set_column(i, f["name"], table.column(i).cast(item))
        elif pa.types.is_list(typ) and pa.types.is_null(typ.value_type):
            table = table.set_column(i, f["name"], table.column(i).cast(pa.list_(item)))
    return table


def _schema(spec: dict[str, Any], table: pa.Table) -> FeatureSchema:
    """The feature schema the run trained on, its mapping resolved against ``table``."""
    dense = [d["name"] for d in spec["dense"]]
    label = spec.get("label", "label")
    fields = tuple(SparseField(f["name"], f["cardinality"], f["multi_hot"]) for f in spec["fields"])
    if not spec.get("mapped"):
        return FeatureSchema(dense=tuple(dense), sparse=fields, label=label)
    sparse, vocab = {}, {}
    for f in spec["fields"]:
        m = f["mapping"]
        if m["kind"] == "vocabulary":
            sparse[f["name"]] = SparseColumn(vocabulary=True, min_count=m["min_count"])
            vocab[f["name"]] = pa.array(m["values"], pa.string() if m["type"] == "string" else pa.int64())
        elif m["kind"] == "hash":
            sparse[f["name"]] = SparseColumn(hash=m["buckets"])
        else:
            sparse[f["name"]] = SparseColumn(cardinality=m["cardinality"])
    transforms = {
        d["name"]: DenseTransform(transform=d["transform"], mean=d["mean"], std=d["std"])
        for d in spec["dense"]
    }
    mapping = SchemaMapping(
        label=label,
        dense=dense,
        sparse=sparse,
        vocabulary_file="model.json" if vocab else None,  # never read: the values are passed
        transforms=transforms,
    )
    if label not in table.column_names:
        table = table.append_column(label, pa.array(np.zeros(table.num_rows, dtype=np.float32)))
    schema = resolve_mapping(mapping, table.schema, _ROWS, vocab)
    for got, want in zip(schema.sparse, fields):
        if got.multi_hot != want.multi_hot:
            shape = "a list of ids" if want.multi_hot else "one id"
            raise DataError(f"the model takes {shape} per row here", path=_ROWS, column=want.name)
    return schema


def _tensors(cols, batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """One field-major CSR over every field, as the program takes it."""
    values = [np.asarray(v, dtype=np.int64) for v in cols.values]
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for v, off in zip(values, cols.offsets):
        offsets.append(np.asarray(off[1:], dtype=np.int64) + base)
        base += len(v)
    flat = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    return (
        torch.from_numpy(np.ascontiguousarray(cols.dense, dtype=np.float32)).reshape(batch, -1),
        torch.from_numpy(flat),
        torch.from_numpy(np.concatenate(offsets)),
    )
