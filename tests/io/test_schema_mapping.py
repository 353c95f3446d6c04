"""A user's own Parquet read through a ``[data.schema]`` mapping (files written by plain
pyarrow and by pandas, without recaccel metadata).

Expected rows are built from ``pyarrow.parquet.read_table().to_pylist()`` and the
one-string-at-a-time reference hash, independent of the vectorized conversion.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomllib
import torch

from recaccel.config import (
    Config,
    DataConfig,
    SchemaMapping,
    SparseColumn,
    config_from_dict,
    config_to_toml,
    load_config,
)
from recaccel.errors import ConfigError, DataError
from recaccel.hashing import splitmix64_63
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.id_hash import hash_int_ids, hash_strings, string_bucket
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.tasks.reader import TaskReader


def _mapping(**kw) -> SchemaMapping:
    return config_from_dict({"data": {"schema": kw}}).data.schema


def _rows(path, mapping: SchemaMapping, **data) -> tuple[list, BatchReader]:
    """Every row the reader yields, in file order: (label, dense, {field: ids})."""
    cfg = DataConfig(train=str(path), schema=mapping, shuffle=False, drop_last=False, **data)
    reader = BatchReader.from_config(path, cfg, train=True)
    rows = []
    for b in reader:
        f_count, bsz = len(b.sparse.keys), b.batch_size
        off, val = b.sparse.offsets.tolist(), b.sparse.values.tolist()
        for i in range(bsz):
            bags = {k: val[off[f * bsz + i] : off[f * bsz + i + 1]] for f, k in enumerate(b.sparse.keys)}
            rows.append((b.labels[i].item(), b.dense[i].tolist(), bags))
        assert f_count == len(mapping.sparse)
    return rows, reader


# ---------------------------------------------------------------- hashing


@pytest.mark.parametrize("large", [False, True])
def test_string_hash_matches_the_reference(large):
    rng = np.random.default_rng(1)
    words = [
        "",
        "a",
        "abcdefgh",
        "abcdefghi",
        "üñíçødé",
        "x" * 70,
        *(f"user_{i}" for i in rng.integers(0, 9999, 40)),
    ]
    values = [None if i % 7 == 3 else w for i, w in enumerate(words)]
    arr = pa.array(values, pa.large_string() if large else pa.string())
    for sliced in (arr, arr.slice(3, 20)):
        got = hash_strings(sliced, 1009)
        for v, g in zip(sliced.to_pylist(), got.tolist()):
            if v is not None:
                assert g == string_bucket(v, 1009)
    binary = pa.array([w.encode() for w in words], pa.binary())
    assert hash_strings(binary, 97).tolist() == [string_bucket(w, 97) for w in words]
    assert len(set(hash_strings(pa.array(words), 2**40).tolist())) == len(set(words))  # no collisions here


def test_int_hash_is_the_ops_id_hash():
    ids = np.array([0, 1, -1, -(2**63), 2**63 - 1, 12345], dtype=np.int64)
    want = (splitmix64_63(torch.from_numpy(ids)) % 1000).numpy()
    np.testing.assert_array_equal(hash_int_ids(ids, 1000), want)
    small = np.array([0, 1, -1, 12345])  # any integer dtype: the id's value decides
    for dtype in (np.int8, np.int32, np.uint16):
        np.testing.assert_array_equal(
            hash_int_ids(small.astype(dtype).astype(np.int64), 7), hash_int_ids(small.astype(dtype), 7)
        )


# ---------------------------------------------------------------- config


def test_schema_table_loads_from_toml_and_serializes_back(tmp_path):
    path = tmp_path / "own.toml"
    path.write_text(
        '[data]\ntrain = "x.parquet"\n\n[data.schema]\nlabel = "clicked"\ndense = ["price", "age"]\n'
        'task_key = "user"\n\n[data.schema.sparse]\nitem = { cardinality = 200 }\n"odd name" = { hash = 64 }\n'
    )
    cfg = load_config(path)
    assert cfg.data.schema == SchemaMapping(
        label="clicked",
        dense=["price", "age"],
        sparse={"item": SparseColumn(cardinality=200), "odd name": SparseColumn(hash=64)},
        task_key="user",
    )
    assert list(cfg.data.schema.sparse) == ["item", "odd name"]  # field order is the file's
    again = config_from_dict(tomllib.loads(config_to_toml(cfg)))
    assert again == cfg and list(again.data.schema.sparse) == ["item", "odd name"]
    assert config_from_dict(tomllib.loads(config_to_toml(Config()))).data.schema is None
    over = load_config(path, ['data.schema={label="y", sparse={i={hash=3}}}'])
    assert over.data.schema == SchemaMapping(label="y", sparse={"i": SparseColumn(hash=3)})


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"sparse": {"i": {"hash": 3, "cardinality": 4}}}, r"data\.schema\.sparse\.i=.*exactly one of"),
        ({"sparse": {"i": {}}}, r"data\.schema\.sparse\.i=.*exactly one of"),
        ({"sparse": {"i": {"buckets": 3}}}, r"unknown config key data\.schema\.sparse\.i\.buckets"),
        (
            {"lable": "y", "dense": ["a"]},
            r"unknown config key data\.schema\.lable \(did you mean data\.schema\.label",
        ),
        ({"sparse": {"i": 5}}, r"data\.schema\.sparse\.i=5 must be a table"),
        ({"sparse": {"i": {"hash": -1}}}, r"data\.schema\.sparse\.i\.hash=-1 must be >= 0"),
        ({"dense": ["a", ""]}, r"data\.schema\.dense\[1\]"),
        ({"label_kind": "stars", "dense": ["a"]}, r"data\.schema\.label_kind=stars must be one of"),
        ({}, r"data\.schema maps no feature"),
        ({"label": "a", "dense": ["a"]}, r"\['a'\] in more than one role"),
        (5, r"data\.schema=5 must be a table"),
    ],
)
def test_bad_schema_tables_are_one_line_naming_the_key(raw, message):
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict({"data": {"schema": raw}})
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- pyarrow-written files


def _pyarrow_file(path, n=40):
    rng = np.random.default_rng(0)
    users = [f"user-{int(i)}" for i in rng.integers(0, 15, n)]
    table = pa.table(
        {
            "clicked": pa.array(rng.integers(0, 2, n).astype(bool)),
            "price": pa.array(rng.random(n), pa.float64()),
            "age": pa.array(rng.integers(18, 80, n), pa.int32()),
            "user": pa.array(users, pa.string()),
            "item": pa.array(rng.integers(0, 50, n), pa.int16()),
            "raw_id": pa.array(rng.integers(-(10**12), 10**12, n), pa.int64()),
            "tags": pa.array([[f"t{int(t)}" for t in rng.integers(0, 9, k)] for k in rng.integers(0, 4, n)]),
            "genres": pa.array(
                [list(rng.integers(0, 5, k)) for k in rng.integers(0, 3, n)], pa.list_(pa.int32())
            ),
            "unused": pa.array(["x"] * n),
        }
    )
    pq.write_table(table, path, row_group_size=16)
    return table


def test_pyarrow_file_reads_with_hashed_strings_and_lists(tmp_path):
    path = tmp_path / "clicks.parquet"
    table = _pyarrow_file(path)
    mapping = _mapping(
        label="clicked",
        dense=["price", "age"],
        sparse={
            "user": {"hash": 100},
            "item": {"cardinality": 50},
            "raw_id": {"hash": 1000},
            "tags": {"hash": 30},
            "genres": {"cardinality": 5},
        },
    )
    rows, reader = _rows(path, mapping)
    assert [f.multi_hot for f in reader.schema.sparse] == [False, False, False, True, False][:3] + [
        True,
        True,
    ]
    assert reader.schema.cardinalities == [100, 50, 1000, 30, 5]
    want = table.to_pylist()
    assert len(rows) == len(want)
    for (label, dense, bags), w in zip(rows, want):
        assert label == float(w["clicked"])
        assert dense == pytest.approx([w["price"], w["age"]], rel=1e-6)
        assert bags["user"] == [string_bucket(w["user"], 100)]
        assert bags["item"] == [w["item"]]
        assert bags["raw_id"] == hash_int_ids(np.array([w["raw_id"]]), 1000).tolist()
        assert bags["tags"] == [string_bucket(t, 30) for t in w["tags"]]
        assert bags["genres"] == w["genres"]


def test_bad_mappings_are_one_line_errors_naming_file_column_and_key(tmp_path):
    path = tmp_path / "clicks.parquet"
    _pyarrow_file(path)
    cases = [
        (
            dict(label="clicked", dense=["prise"]),
            r"file .*clicks\.parquet, column 'prise': no such column "
            r"\(named by config key data\.schema\.dense\[0\]\); the file has: clicked, price",
        ),
        (
            dict(label="user", dense=["price"]),
            r"column 'user': column has type string; a label column must be",
        ),
        (
            dict(label="clicked", sparse={"user": {"cardinality": 10}}),
            r"column 'user'.*string ids need hash = N "
            r"buckets \(data\.schema\.sparse\.user\.hash\)",
        ),
        (
            dict(label="clicked", dense=["age"], task_key="price"),  # floats are not keys
            r"column 'price'.*a task key must be an integer or string column",
        ),
        (dict(label="clicked", dense=["tags"]), r"column 'tags'.*a dense column must be"),
    ]
    for raw, message in cases:
        with pytest.raises(DataError, match=message) as err:
            open_dataset(path, _mapping(**raw))
        assert "\n" not in str(err.value)
    # A cardinality the data exceeds, under the error policy: the first bad id and its row.
    mapping = _mapping(label="clicked", sparse={"item": {"cardinality": 10}})
    with pytest.raises(
        DataError, match=r"row group 0, column 'item': invalid id \d+ at row \d+ \(valid ids are 0\.\.9\)"
    ):
        _rows(path, mapping)
    rows, reader = _rows(path, mapping, invalid_ids="hash")
    assert (
        len(rows) == 40 and all(0 <= r[2]["item"][0] < 10 for r in rows) and reader.counters["ids_hashed"] > 0
    )


def test_a_later_file_of_another_shape_is_refused(tmp_path):
    pq.write_table(pa.table({"y": [0.0, 1.0], "c": pa.array([1, 2])}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"y": [0.0, 1.0], "c": pa.array([[1], [2]])}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet, column 'c': column holds a list per row here but not"):
        open_dataset(tmp_path, _mapping(label="y", sparse={"c": {"cardinality": 5}}))


def test_stored_recaccel_schema_is_ignored_when_a_mapping_is_given(tmp_path):
    from recaccel.io.format.schema import FeatureSchema, SparseField
    from recaccel.io.format.writer import write_parquet

    schema = FeatureSchema(dense=("d",), sparse=(SparseField("s", 10),))
    write_parquet(tmp_path / "r.parquet", schema, {"label": [1.0, 0.0], "d": [0.5, 0.25], "s": [3, 4]})
    info = open_dataset(tmp_path / "r.parquet", _mapping(label="label", sparse={"s": {"hash": 7}}))
    assert info.schema.dense == () and info.schema.cardinalities == [7]
    assert open_dataset(tmp_path / "r.parquet").schema == schema  # the metadata path is unchanged


# ---------------------------------------------------------------- pandas-written files, missing values


def _pandas_file(path) -> pd.DataFrame:
    df = pd.DataFrame(
        {
            "rating": [4.0, 3.0, np.nan, 5.0, 1.0, 2.0],
            "price": [1.5, np.nan, 2.0, 3.0, 4.0, 0.5],
            "item": [1, 2, 3, np.nan, 4, 0],  # pandas: float64 with a NaN -> Parquet double with a null
            "city": pd.Categorical(["paris", "rome", "paris", None, "oslo", "rome"]),
            "user": ["a", "b", None, "c", "d", "e"],
        }
    )
    df.to_parquet(path, index=False)
    return df


MISSING = dict(label="rating", label_kind="rating", dense=["price"])


def test_pandas_file_hashes_categoricals_and_takes_float_ids(tmp_path):
    path = tmp_path / "ratings.parquet"
    _pandas_file(path)
    assert pa.types.is_dictionary(pq.read_schema(path).field("city").type)
    mapping = _mapping(
        **MISSING, sparse={"item": {"cardinality": 5}, "city": {"hash": 16}, "user": {"hash": 8}}
    )
    rows, reader = _rows(path, mapping, invalid_ids="skip", invalid_dense="skip", invalid_labels="skip")
    # Rows 1 (price), 2 (label, user) and 3 (item, city) hold a missing value: dropped and counted.
    assert [r[0] for r in rows] == [4.0, 1.0, 2.0]
    assert [r[2]["item"] for r in rows] == [[1], [4], [0]]
    assert [r[2]["city"] for r in rows] == [[string_bucket(c, 16)] for c in ("paris", "oslo", "rome")]
    assert [r[2]["user"] for r in rows] == [[string_bucket(u, 8)] for u in ("a", "d", "e")]
    c = reader.counters
    assert (c["rows_skipped"], c["rows_skipped_invalid_ids"], c["rows_skipped_invalid_dense"]) == (3, 2, 1)
    assert c["rows_skipped_invalid_labels"] == 1


@pytest.mark.parametrize(
    "policies, error",
    [
        (
            dict(invalid_labels="error", invalid_dense="zero", invalid_ids="skip"),
            r"column 'rating': invalid label null at row 2",
        ),
        (
            dict(invalid_labels="skip", invalid_dense="error", invalid_ids="skip"),
            r"column 'price': invalid dense value null at row 1",
        ),
        (
            dict(invalid_labels="skip", invalid_dense="zero", invalid_ids="error"),
            r"column 'item': null id at row 3",
        ),
    ],
)
def test_missing_values_under_error_policies_name_column_and_row(tmp_path, policies, error):
    path = tmp_path / "ratings.parquet"
    _pandas_file(path)
    mapping = _mapping(**MISSING, sparse={"item": {"cardinality": 5}})
    with pytest.raises(DataError, match=error):
        _rows(path, mapping, **policies)


@pytest.mark.parametrize("ids", ["clip", "hash", "skip"])
def test_missing_ids_drop_their_rows_under_every_repairing_policy(tmp_path, ids):
    path = tmp_path / "ratings.parquet"
    _pandas_file(path)
    mapping = _mapping(**MISSING, sparse={"item": {"cardinality": 3}})  # item 3 and 4 are out of range
    rows, reader = _rows(path, mapping, invalid_ids=ids, invalid_dense="zero", invalid_labels="skip")
    items = [r[2]["item"][0] for r in rows]
    dense = [r[1][0] for r in rows]
    if ids == "skip":  # row 2 (null label), 3 (null item), 4 (item 4 out of range)
        assert items == [1, 2, 0] and dense == [1.5, 0.0, 0.5]
    else:  # the null id's row is dropped; 4 is clipped to 2 or hashed to 4 mod 3 = 1
        assert items == [1, 2, 2 if ids == "clip" else 1, 0]
        assert dense == [1.5, 0.0, 4.0, 0.5]
    assert reader.counters["dense_zeroed"] == 1


def test_non_whole_float_ids_are_refused(tmp_path):
    path = tmp_path / "f.parquet"
    pd.DataFrame({"y": [1.0, 0.0], "item": [1.0, 2.5]}).to_parquet(path)
    with pytest.raises(DataError, match=r"column 'item': id 2\.5 at row 1 is not a whole number"):
        _rows(path, _mapping(label="y", sparse={"item": {"cardinality": 5}}))


# ---------------------------------------------------------------- meta data: task key and timestamp


def test_meta_dataset_with_task_key_and_timestamp(tmp_path):
    rng = np.random.default_rng(3)
    users = np.repeat(np.arange(10, 16), 8)  # sorted by the task key, as the task reader needs
    n = users.size
    df = pd.DataFrame(
        {
            "user_id": users,
            "movie": [f"m{int(i)}" for i in rng.integers(0, 40, n)],
            "stars": rng.integers(1, 6, n).astype(float),
            "when": pd.to_datetime(rng.permutation(n) * 1000 + 1_600_000_000, unit="s"),
        }
    )
    path = tmp_path / "ratings.parquet"
    df.to_parquet(path, index=False, row_group_size=16)
    assert pa.types.is_timestamp(pq.read_schema(path).field("when").type)
    cfg = load_config(
        None,
        [
            'data.schema={label="stars", label_kind="rating", task_key="user_id", timestamp="when", '
            "sparse={movie={hash=64}}}",
            "tasks.split=time",
            "tasks.query_count=2",
            "tasks.support_size=8",
            "tasks.query_size=2",
            "tasks.tasks_per_batch=3",
            "data.shuffle=false",
        ],
    )
    reader = TaskReader.from_config(path, cfg, train=False)
    seen = {}
    for tb in reader:
        q_labels = tb.query.labels.view(tb.query_mask.shape)
        q_movies = tb.query.sparse.values.view(tb.query_mask.shape)
        for t, key in enumerate(tb.task_ids.tolist()):
            assert tb.query_mask[t].sum() == 2 and tb.support_mask[t].sum() == 6
            seen[key] = (sorted(q_labels[t].tolist()), sorted(q_movies[t].tolist()))
    assert sorted(seen) == list(range(10, 16))
    for key, (labels, movies) in seen.items():
        latest = df[df.user_id == key].sort_values("when").tail(2)  # split=time: the latest 2 are the query
        assert labels == sorted(latest.stars.tolist())
        assert movies == sorted(string_bucket(m, 64) for m in latest.movie)


@pytest.mark.parametrize("categorical", [False, True])
def test_string_task_keys_decode_to_their_63_bit_task_ids(tmp_path, categorical):
    from recaccel.io.format.dataset import RowGroupReader
    from recaccel.io.format.decode import Policies, Projection, new_decode_stats
    from recaccel.io.format.grouping import task_id

    path = tmp_path / "s.parquet"
    keys = ["alice", "bob", "alice"]
    frame = pd.DataFrame(
        {"u": pd.Categorical(keys) if categorical else keys, "y": [1.0, 0.0, 1.0], "i": [1, 2, 0]}
    )
    frame.to_parquet(path)
    info = open_dataset(path, _mapping(label="y", task_key="u", sparse={"i": {"cardinality": 3}}))
    reader = RowGroupReader(
        info.schema, Projection.select(info.schema, None, ("u",)), Policies(), new_decode_stats()
    )
    cols = reader.read(info.row_groups[0])
    reader.close()
    assert cols.side["u"].tolist() == [task_id(k) for k in keys]


# ---------------------------------------------------------------- training end to end


def test_training_on_a_pandas_file_through_the_api(tmp_path):
    from recaccel import api

    rng = np.random.default_rng(0)
    n = 600
    city = rng.choice(["paris", "rome", "oslo", "lima"], n)
    df = pd.DataFrame(
        {
            "clicked": (city == "rome").astype(int),
            "price": rng.random(n),
            "city": city,
            "item": rng.integers(0, 20, n),
            "tags": [list(rng.integers(0, 8, k)) for k in rng.integers(0, 3, n)],
        }
    )
    df.iloc[:500].to_parquet(tmp_path / "train.parquet", index=False)
    df.iloc[500:].to_parquet(tmp_path / "test.parquet", index=False)
    cfg = load_config(
        None,
        [
            f'data.train="{tmp_path / "train.parquet"}"',
            f'data.test="{tmp_path / "test.parquet"}"',
            'data.schema={label="clicked", dense=["price"], sparse={city={hash=16}, item={cardinality=20}, '
            "tags={cardinality=8}}}",
            "data.batch_size=50",
            f'train.out_dir="{tmp_path / "run"}"',
            "train.steps=40",
            "train.progress=false",
            "train.device=cpu",
            "model.embedding_dim=4",
            "model.bottom_mlp=[8,4]",
            "model.top_mlp=[8,1]",
            "optim.lr=0.01",
        ],
    )
    metrics = api.train(cfg)
    assert metrics["auc"] > 0.9  # the label is one city: learnable from the hashed strings
    saved = load_config(tmp_path / "run" / "config.toml")
    assert saved.data.schema == cfg.data.schema
