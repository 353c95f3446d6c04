import pyarrow as pa
import pytest
import torch

from recaccel.errors import DataError
from recaccel.io.batch import Batch, SparseFeatures
from recaccel.io.schema import FeatureSchema, SparseField


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
    schema = FeatureSchema(("d0", "d1"), (SparseField("c0", 10), SparseField("c1", 5, multi_hot=True)),
                           task_key="user", timestamp="ts")
    assert FeatureSchema.from_json(schema.to_json()) == schema
    arrow = schema.arrow_schema()
    assert arrow.field("c1").type == pa.list_(pa.int64())
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
