import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recaccel.errors import DataError
from recaccel.io.format import write_parquet
from recaccel.io.format.schema import SCHEMA_METADATA_KEY, FeatureSchema, SparseField
from recaccel.sparse import Batch, SparseFeatures


def _sparse() -> SparseFeatures:
    # F=2 fields, B=3 rows; field "b" has an empty bag in row 1.
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    lengths = torch.tensor([1, 2, 1, 2, 0, 1])
    return SparseFeatures.from_lengths(["a", "b"], values, lengths, weights=torch.arange(7.0))


def test_sparse_features_fields_and_lengths():
    sf = _sparse()
    assert sf.batch_size == 3 and sf.num_fields == 2
    torch.testing.assert_close(sf.lengths(), torch.tensor([1, 2, 1, 2, 0, 1]))
    values, offsets, weights = sf.field("b")
    torch.testing.assert_close(values, torch.tensor([5, 6, 7]))
    torch.testing.assert_close(offsets, torch.tensor([0, 2, 2, 3]))
    torch.testing.assert_close(weights, torch.tensor([4.0, 5.0, 6.0]))


def test_sparse_features_rejects_bad_offsets():
    with pytest.raises(ValueError, match="F\\*B\\+1"):
        SparseFeatures(["a", "b"], torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 2, 3]))


def test_kjt_round_trip_shares_memory():
    pytest.importorskip("torchrec")
    sf = _sparse()
    kjt = sf.to_kjt()
    assert kjt.values().data_ptr() == sf.values.data_ptr()
    assert kjt.offsets().data_ptr() == sf.offsets.data_ptr()
    torch.testing.assert_close(kjt.lengths(), sf.lengths())
    assert kjt["b"].values().tolist() == [5, 6, 7]
    back = SparseFeatures.from_kjt(kjt)
    assert back.keys == sf.keys and back.values.data_ptr() == sf.values.data_ptr()
    assert back.weights.data_ptr() == sf.weights.data_ptr()


def test_batch_to_moves_every_tensor():
    b = Batch(torch.zeros(3, 2), _sparse(), torch.zeros(3), torch.ones(3))
    moved = b.to("cpu")
    assert moved.batch_size == 3 and moved.sparse.keys == ["a", "b"]


def test_schema_json_and_arrow_round_trip():
    schema = FeatureSchema(
        ("d0", "d1"),
        (SparseField("c0", 10), SparseField("c1", 5, multi_hot=True)),
        task_key="user",
        timestamp="ts",
    )
    assert FeatureSchema.from_json(schema.to_json()) == schema
    arrow = schema.arrow_schema()
    assert arrow.field("c1").type == pa.list_(pa.int32())  # ids stored as int32 where they fit
    assert arrow.field("user").type == pa.int64()
    assert FeatureSchema.from_arrow(arrow, "x.parquet") == schema
    schema.validate_arrow(arrow, "x.parquet")


def test_schema_validation_names_file_and_column():
    schema = FeatureSchema(("d0",), (SparseField("c0", 10),))
    missing = pa.schema([pa.field("label", pa.float32()), pa.field("d0", pa.float32())])
    with pytest.raises(DataError, match=r"file f\.parquet.*column 'c0'.*missing"):
        schema.validate_arrow(missing, "f.parquet")
    wrong = missing.append(pa.field("c0", pa.string()))
    with pytest.raises(DataError, match=r"column 'c0'.*type string"):
        schema.validate_arrow(wrong, "f.parquet")
    with pytest.raises(DataError, match="no recaccel schema"):
        FeatureSchema.from_arrow(missing, "f.parquet")


def test_schema_rejects_bad_definitions():
    with pytest.raises(DataError, match="cardinality"):
        SparseField("c", 0)
    with pytest.raises(DataError, match="duplicate"):
        FeatureSchema(("x",), (SparseField("x", 3),))
    with pytest.raises(DataError, match="label_kind"):
        FeatureSchema((), (SparseField("x", 3),), label_kind="ordinal")


# ---------------------------------------------------------------- stored schema metadata (issue 10 item 9)

_GOOD = {
    "dense": ["d0"],
    "sparse": [{"name": "s0", "cardinality": 5, "multi_hot": False}],
    "label": "label",
    "label_kind": "binary",
    "task_key": None,
    "timestamp": None,
    "extra": {},
}


def _with(**changes) -> bytes:
    return json.dumps({**_GOOD, **changes}).encode()


def _field(**changes) -> list:
    return [{**_GOOD["sparse"][0], **changes}]


@pytest.mark.parametrize(
    "meta, message",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[1, 2]", "the schema must be a JSON object, got list"),
        (b'"text"', "the schema must be a JSON object, got str"),
        (
            json.dumps({k: v for k, v in _GOOD.items() if k != "dense"}).encode(),
            r"lacks key\(s\) \['dense'\]",
        ),
        (_with(bogus=1), r"unknown key\(s\) \['bogus'\]"),
        (_with(dense="d0"), "dense must be a list"),
        (_with(dense=[1]), "dense must be a list of column names"),
        (_with(sparse={"s0": 5}), "sparse must be a list"),
        (_with(sparse=[5]), r"sparse\[0\] must be a JSON object"),
        (_with(sparse=[{"name": "s0"}]), r"sparse\[0\] lacks key\(s\) \['cardinality'\]"),
        (
            _with(sparse=[{"name": "s0", "cardinality": 5, "hot": 1}]),
            r"sparse\[0\] has unknown key\(s\) \['hot'\]",
        ),
        (_with(sparse=_field(cardinality="5")), "cardinality '5'; must be an integer"),
        (_with(sparse=_field(cardinality=5.0)), "cardinality 5.0; must be an integer"),
        (_with(sparse=_field(cardinality=True)), "cardinality True; must be an integer"),
        (_with(sparse=_field(cardinality=0)), "cardinality 0; must be in 1.."),
        (_with(sparse=_field(cardinality=2**64)), f"cardinality {2**64}; must be in 1.."),
        (_with(sparse=_field(multi_hot="yes")), "multi_hot 'yes'"),
        (_with(sparse=_field(name=3)), "sparse field name must be a non-empty string"),
        (_with(dense=["s0"]), r"duplicate column names: \['s0'\]"),
        (_with(label_kind="ordinal"), "label_kind must be 'binary' or 'rating'"),
        (_with(label=None), "schema label must be a column name"),
        (_with(task_key=7), "schema task_key must be a column name"),
        (_with(extra=[]), "schema extra must be an object"),
    ],
)
def test_broken_schema_metadata_is_one_line_naming_the_file(meta, message):
    arrow = FeatureSchema.from_json(json.dumps(_GOOD)).arrow_schema()
    arrow = arrow.with_metadata({SCHEMA_METADATA_KEY: meta})
    prefix = r"^file f\.parquet: bad recaccel\.schema metadata: .*"
    with pytest.raises(DataError, match=prefix + message) as err:
        FeatureSchema.from_arrow(arrow, "f.parquet")
    assert "\n" not in str(err.value) and err.value.path == "f.parquet"


def test_schema_read_from_a_file_remembers_it_but_not_in_equality_or_json():
    schema = FeatureSchema(("d0",), (SparseField("s0", np.int64(5), np.bool_(True)),))
    assert type(schema.sparse[0].cardinality) is int and schema.sparse[0].multi_hot is True
    read = FeatureSchema.from_arrow(schema.arrow_schema(), "f.parquet")
    assert read.origin == "f.parquet" and read == schema
    assert "origin" not in json.loads(read.to_json())


def test_ids_are_stored_as_int32_where_the_cardinality_fits_and_int64_beyond():
    narrow, wide = SparseField("a", 2**31), SparseField("b", 2**31 + 1, multi_hot=True)
    assert narrow.arrow_type() == pa.int32()
    assert wide.arrow_type() == pa.list_(pa.int64())


def test_writer_refuses_ids_beyond_the_stored_int32_naming_column_and_id(tmp_path):
    schema = FeatureSchema(("d0",), (SparseField("c0", 10), SparseField("m0", 10, multi_hot=True)))
    good = {"label": np.zeros(2, np.float32), "d0": np.zeros(2, np.float32)}
    cases = {
        "c0": (np.array([1, 2**40], np.int64), "id 1099511627776"),
        "m0": ((np.array([3, -(2**33)], np.int64), np.array([0, 1, 2])), "id -8589934592"),
    }
    for column, (bad, named) in cases.items():
        cols = dict(good, c0=np.array([1, 2]), m0=(np.array([1, 2]), np.array([0, 1, 2])))
        cols[column] = bad
        with pytest.raises(DataError, match=f"{named} does not fit") as err:
            write_parquet(tmp_path / column, schema, cols)
        assert column in str(err.value) and "\n" not in str(err.value)
    arrow_bad = dict(good, c0=pa.array([5, 2**35], pa.int64()), m0=(np.array([1, 2]), np.array([0, 1, 2])))
    with pytest.raises(DataError, match="id 34359738368 does not fit"):
        write_parquet(tmp_path / "arrow", schema, arrow_bad)


def test_ids_out_of_range_but_within_int32_are_written_for_the_read_policies(tmp_path):
    schema = FeatureSchema(("d0",), (SparseField("c0", 10),))
    cols = {
        "label": np.zeros(3, np.float32),
        "d0": np.zeros(3, np.float32),
        "c0": np.array([-1, 10, 2**31 - 1]),
    }
    (path,) = write_parquet(tmp_path, schema, cols)
    assert pq.read_table(path).column("c0").to_pylist() == [-1, 10, 2**31 - 1]
