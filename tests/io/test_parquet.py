"""Parquet writer and streaming reader, checked against pyarrow.parquet.read_table.

Row tuples ``(label, dense tuple, bags tuple)`` are built from ``read_table().to_pylist()``
(independent of recaccel's numpy code) and from the yielded batches' field-major CSR.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recaccel.config import DataConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.columns import Columns, take_csr
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.decode import Policies
from recaccel.io.format.schema import SCHEMA_METADATA_KEY, FeatureSchema, SparseField
from recaccel.io.format.writer import DatasetWriter, write_parquet
from recaccel.io.readers.options import ReadOptions, Shard
from recaccel.io.readers.rows import BatchReader
from tests.helpers.row_data import make_columns, make_schema, small_dataset

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXACT = dict(rtol=0, atol=0)


# ---------------------------------------------------------------- data helpers


@st.composite
def datasets(draw, min_rows: int = 0, max_rows: int = 200):
    num_dense = draw(st.integers(1, 4))
    num_sparse = draw(st.integers(1, 5))
    multi_hot = draw(st.lists(st.booleans(), min_size=num_sparse, max_size=num_sparse))
    cards = draw(st.lists(st.integers(1, 1000), min_size=num_sparse, max_size=num_sparse))
    n = draw(st.one_of(st.sampled_from([min_rows, min_rows + 1]), st.integers(min_rows, max_rows)))
    rg = draw(st.integers(1, 64))
    per_file = draw(st.one_of(st.none(), st.integers(1, 150)))
    return make_schema(num_dense, multi_hot, cards), n, rg, per_file, draw(st.integers(0, 2**16))


def reference_rows(path: Path, schema: FeatureSchema, columns: list[str] | None = None) -> list[tuple]:
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    dense = [d for d in schema.dense if columns is None or d in columns]
    sparse = [f for f in schema.sparse if columns is None or f.name in columns]
    rows = []
    for p in files:
        for r in pq.read_table(p).to_pylist():
            bags = tuple(tuple(r[f.name]) if f.multi_hot else (r[f.name],) for f in sparse)
            rows.append((float(r[schema.label]), tuple(float(r[d]) for d in dense), bags))
    return rows


def batch_rows(batch) -> list[tuple]:
    b, keys = batch.batch_size, batch.sparse.keys
    off, vals = batch.sparse.offsets.tolist(), batch.sparse.values.tolist()
    dense, labels = batch.dense.tolist(), batch.labels.tolist()
    return [
        (
            labels[i],
            tuple(dense[i]),
            tuple(tuple(vals[off[f * b + i] : off[f * b + i + 1]]) for f in range(len(keys))),
        )
        for i in range(b)
    ]


def check_batch_equals_rows(batch, rows: list[tuple], keys: list[str]) -> None:
    """Exact tensors (dtypes, shapes, field-major values and offsets) against reference rows."""
    b, nf = len(rows), len(keys)
    bags = [rows[i][2][f] for f in range(nf) for i in range(b)]
    lengths = torch.tensor([len(bag) for bag in bags], dtype=torch.int64)
    offsets = torch.zeros(nf * b + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    values = torch.tensor([v for bag in bags for v in bag], dtype=torch.int64)
    dense = torch.tensor([r[1] for r in rows], dtype=torch.float32).reshape(b, -1)
    assert batch.sparse.keys == keys
    torch.testing.assert_close(batch.sparse.offsets, offsets, **EXACT)
    assert batch.sparse.values.dtype in (torch.int32, torch.int64)  # int32 where the tables fit
    torch.testing.assert_close(batch.sparse.values.long(), values, **EXACT)
    torch.testing.assert_close(batch.dense, dense, **EXACT)
    torch.testing.assert_close(batch.labels, torch.tensor([r[0] for r in rows], dtype=torch.float32), **EXACT)


def all_rows(batches) -> list[tuple]:
    return [row for batch in batches for row in batch_rows(batch)]


def same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.sparse.keys == y.sparse.keys
        for t, u in ((x.dense, y.dense), (x.labels, y.labels), (x.sparse.values, y.sparse.values)):
            torch.testing.assert_close(t, u, **EXACT)
        torch.testing.assert_close(x.sparse.offsets, y.sparse.offsets, **EXACT)


# ---------------------------------------------------------------- writer and plain reading


@SETTINGS
@given(datasets(), st.integers(1, 50), st.booleans(), st.integers(0, 2))
def test_roundtrip_in_file_order(spec, batch_size, drop_last, style):
    schema, n, rg, per_file, seed = spec
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = write_parquet(
            tmp, schema, make_columns(schema, n, seed, style), rows_per_row_group=rg, rows_per_file=per_file
        )
        assert paths == sorted(tmp.glob("*.parquet")) and paths[0].name == "part-00000.parquet"
        for i, p in enumerate(paths):
            md = pq.ParquetFile(p).metadata
            sizes = [md.row_group(j).num_rows for j in range(md.num_row_groups)]
            assert all(s == rg for s in sizes[:-1]) and all(s <= rg for s in sizes)
            if per_file is not None and i < len(paths) - 1:
                assert md.num_rows == per_file
        info = open_dataset(tmp)
        assert info.schema == schema and info.num_rows == n
        ref = reference_rows(tmp, schema)
        assert len(ref) == n
        reader = BatchReader(tmp, batch_size, ReadOptions(shuffle=False, drop_last=drop_last))
        batches = list(reader)
        keep = (n // batch_size) * batch_size if drop_last else n
        assert [b.batch_size for b in batches] == [
            min(batch_size, keep - i) for i in range(0, keep, batch_size)
        ]
        for k, batch in enumerate(batches):
            ids = (
                torch.int32
                if max((f.cardinality for f in schema.sparse), default=1) <= 2**31
                else torch.int64
            )
            assert batch.dense.dtype == torch.float32 and batch.sparse.values.dtype == ids
            check_batch_equals_rows(batch, ref[k * batch_size : (k + 1) * batch_size], schema.sparse_names)
        assert reader.counters["rows_yielded"] == keep and reader.counters["rows_dropped_last"] == n - keep
        assert reader.state_dict()["epoch_done"]


@SETTINGS
@given(datasets(max_rows=120), st.lists(st.integers(0, 40), min_size=1, max_size=6))
def test_streaming_writer_matches_single_write(spec, chunks):
    schema, n, rg, per_file, seed = spec
    cols = make_columns(schema, n, seed)
    bounds = np.unique(np.clip(np.cumsum([0, *chunks]), 0, n)).tolist() + [n]
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        write_parquet(a, schema, cols, rows_per_row_group=rg, rows_per_file=per_file)
        with DatasetWriter(b, schema, rg, per_file) as w:
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                w.write({k: _slice_column(v, lo, hi) for k, v in cols.items()})
        for pa_, pb in zip(sorted(Path(a).glob("*")), sorted(Path(b).glob("*"))):
            assert pa_.name == pb.name
            assert pq.read_table(pa_).equals(pq.read_table(pb))
            assert pq.ParquetFile(pa_).metadata.num_row_groups == pq.ParquetFile(pb).metadata.num_row_groups
        assert len(list(Path(a).glob("*"))) == len(list(Path(b).glob("*")))


def _slice_column(v, lo, hi):
    if isinstance(v, tuple):
        values, offsets = v
        return values[offsets[lo] : offsets[hi]], offsets[lo : hi + 1] - offsets[lo]
    return v[lo:hi]


def test_writer_rejects_bad_structure(tmp_path):
    schema = make_schema(1, [False, True], [5, 5])
    good = make_columns(schema, 4, 0)
    with pytest.raises(DataError, match="'s0'.*missing"):
        write_parquet(tmp_path / "a", schema, {k: v for k, v in good.items() if k != "s0"})
    with pytest.raises(DataError, match="'typo'"):
        write_parquet(tmp_path / "b", schema, {**good, "typo": np.zeros(4)})
    with pytest.raises(DataError, match="different lengths.*d0=3"):
        write_parquet(tmp_path / "c", schema, {**good, "d0": np.zeros(3)})
    with pytest.raises(DataError, match="'s0'.*integer ids"):
        write_parquet(tmp_path / "d", schema, {**good, "s0": np.zeros(4)})
    with pytest.raises(DataError, match="'s1'.*offsets"):
        write_parquet(tmp_path / "e", schema, {**good, "s1": (np.arange(3), np.array([0, 1, 2, 5, 3]))})
    write_parquet(tmp_path / "f", schema, good)
    with pytest.raises(DataError, match="part-00000.parquet.*already exists"):
        write_parquet(tmp_path / "f", schema, good)
    write_parquet(tmp_path / "f", schema, make_columns(schema, 2, 1), overwrite=True)
    assert open_dataset(tmp_path / "f").num_rows == 2


def test_writer_discards_partial_file_on_error(tmp_path):
    schema = make_schema(1, [False], [5])
    with pytest.raises(RuntimeError):
        with DatasetWriter(tmp_path, schema, 2, 3) as w:
            w.write(make_columns(schema, 5, 0))  # one full file, a partial second
            raise RuntimeError("generator failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00000.parquet"]


def test_reader_casts_wider_types(tmp_path):
    schema = make_schema(2, [False, True], [10, 10])
    table = pa.table(
        {
            "label": pa.array([1.0, 0.0], pa.float64()),
            "d0": pa.array([1.5, -2.25], pa.float64()),
            "d1": pa.array([3, 4], pa.int32()),
            "s0": pa.array([9, 0], pa.int32()),
            "s1": pa.array([[1, 2], []], pa.list_(pa.int32())),
        }
    )
    pq.write_table(table, tmp_path / "x.parquet")  # a foreign file: no recaccel metadata
    with pytest.raises(DataError, match="x.parquet.*no recaccel schema"):
        open_dataset(tmp_path)
    (batch,) = list(BatchReader(tmp_path, 8, ReadOptions(shuffle=False), schema=schema))
    check_batch_equals_rows(
        batch, [(1.0, (1.5, 3.0), ((9,), (1, 2))), (0.0, (-2.25, 4.0), ((0,), ()))], ["s0", "s1"]
    )


def test_columns_take_and_concat_match_python():
    rng = np.random.default_rng(3)
    n = 40
    lengths = rng.integers(0, 5, n)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    vals = rng.integers(0, 100, int(off[-1]))
    bags = [vals[off[i] : off[i + 1]].tolist() for i in range(n)]
    idx = rng.integers(0, n, 70)  # repeats and any order
    v, o = take_csr(vals, off, idx)
    assert [v[o[j] : o[j + 1]].tolist() for j in range(len(idx))] == [bags[i] for i in idx]
    cols = Columns(
        rng.random((n, 2)).astype(np.float32),
        rng.random(n).astype(np.float32),
        ["a", "b"],
        [vals, np.arange(n)],
        [off, np.arange(n + 1)],
    )
    joined = Columns.concat([cols.slice(0, 13), cols.take(np.arange(13, 30)), cols.slice(30, n)])
    check_batch_equals_rows(joined.to_batch(), batch_rows(cols.to_batch()), ["a", "b"])
    empty = Columns.empty(["a"], 3).to_batch()
    assert empty.dense.shape == (0, 3) and empty.sparse.offsets.tolist() == [0]


# ---------------------------------------------------------------- shuffle, shards, resume, memory


@SETTINGS
@given(datasets(min_rows=20), st.integers(1, 40), st.integers(1, 100))
def test_shuffle_is_a_seeded_permutation(spec, batch_size, buffer_rows):
    schema, n, rg, per_file, seed = spec
    with tempfile.TemporaryDirectory() as tmp:
        write_parquet(
            tmp, schema, make_columns(schema, n, seed), rows_per_row_group=rg, rows_per_file=per_file
        )
        ref = reference_rows(Path(tmp), schema)

        def read(s, epoch=0):
            reader = BatchReader(tmp, batch_size, ReadOptions(seed=s), shuffle_buffer_rows=buffer_rows)
            reader.set_epoch(epoch)
            return list(reader)

        first, again, other, epoch1 = read(7), read(7), read(8), read(7, epoch=1)
        assert Counter(all_rows(first)) == Counter(ref)
        assert [b.batch_size for b in first[:-1]] == [batch_size] * (len(first) - 1)
        same_batches(first, again)
        # 20+ distinct-position rows: a repeated order has probability <= 1/20!.
        assert all_rows(other) != all_rows(first) and all_rows(epoch1) != all_rows(first)
        assert Counter(all_rows(epoch1)) == Counter(ref)


@SETTINGS
@given(datasets(), st.integers(1, 30), st.integers(2, 3), st.booleans())
def test_ranks_partition_the_rows(spec, batch_size, world_size, shuffle):
    schema, n, rg, per_file, seed = spec
    with tempfile.TemporaryDirectory() as tmp:
        write_parquet(
            tmp, schema, make_columns(schema, n, seed), rows_per_row_group=rg, rows_per_file=per_file
        )
        rows = []
        for rank in range(world_size):
            reader = BatchReader(
                tmp,
                batch_size,
                ReadOptions(shuffle=shuffle, seed=seed, shard=Shard(rank=rank, world_size=world_size)),
                shuffle_buffer_rows=17,
            )
            rows += all_rows(reader)
        assert Counter(rows) == Counter(reference_rows(Path(tmp), schema))


@pytest.mark.parametrize("codec", ["lz4", "zstd", "none"])
def test_every_codec_reads_back_the_same_rows(tmp_path, codec):
    schema = make_schema(2, [False, True], [50, 20])
    cols = make_columns(schema, 90, 4)
    write_parquet(tmp_path / "snappy", schema, cols, rows_per_row_group=40)
    write_parquet(tmp_path / codec, schema, cols, rows_per_row_group=40, compression=codec)
    meta = pq.ParquetFile(next((tmp_path / codec).glob("*.parquet"))).metadata
    assert (
        meta.row_group(0).column(0).compression
        == {"lz4": "LZ4", "zstd": "ZSTD", "none": "UNCOMPRESSED"}[codec]
    )
    read = [all_rows(BatchReader(tmp_path / d, 16, ReadOptions(shuffle=False))) for d in ("snappy", codec)]
    assert read[0] == read[1] == reference_rows(tmp_path / "snappy", schema)
    with pytest.raises(ConfigError, match="compression must be one of"):
        write_parquet(tmp_path / "bad", schema, cols, compression="brotli2")


@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_and_dataloader_workers_partition_the_rows(tmp_path, shuffle):
    schema = small_dataset(tmp_path, n=500, rg=20)
    rows = []
    for rank in range(2):
        reader = BatchReader(
            tmp_path,
            16,
            ReadOptions(shuffle=shuffle, seed=3, shard=Shard(rank=rank, world_size=2)),
            shuffle_buffer_rows=50,
        )
        rows += all_rows(torch.utils.data.DataLoader(reader, batch_size=None, num_workers=2))
    assert Counter(rows) == Counter(reference_rows(tmp_path, schema))


@SETTINGS
@given(datasets(min_rows=1), st.integers(1, 30), st.booleans(), st.booleans(), st.integers(1, 60), st.data())
def test_resume_yields_exactly_the_remaining_batches(spec, batch_size, shuffle, drop_last, buffer_rows, data):
    schema, n, rg, per_file, seed = spec
    with tempfile.TemporaryDirectory() as tmp:
        write_parquet(
            tmp, schema, make_columns(schema, n, seed), rows_per_row_group=rg, rows_per_file=per_file
        )
        kw = dict(
            options=ReadOptions(shuffle=shuffle, drop_last=drop_last, seed=seed),
            shuffle_buffer_rows=buffer_rows,
        )
        full = BatchReader(tmp, batch_size, **kw)
        full.set_epoch(2)
        expected = list(full)
        k = data.draw(st.integers(0, len(expected)), label="k")
        head = BatchReader(tmp, batch_size, **kw)
        head.set_epoch(2)
        it = iter(head)
        got = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(head.state_dict()))
        finished = k == len(expected) > 0  # before the first next() nothing has run yet
        assert state["epoch_done"] == finished
        resumed = BatchReader(tmp, batch_size, **kw)
        resumed.load_state_dict(state)
        rest = list(resumed)
        if finished:  # a finished epoch resumes at the next one
            assert state["counters"] == full.counters
            full.set_epoch(3)
            same_batches(rest, list(full))
        else:
            same_batches(got + rest, expected)
            # The counters travel with the position: the resumed reader ends with the
            # uninterrupted one's (a partly read buffer's decode is not counted twice).
            assert resumed.counters == full.counters
        if k < len(expected):  # the same reader object, iterated again, also continues
            same_batches(got + list(head), expected)


def test_iteration_without_set_epoch_moves_to_next_epoch(tmp_path):
    small_dataset(tmp_path)
    reader = BatchReader(tmp_path, 32, shuffle_buffer_rows=50)
    e0, e1 = list(reader), list(reader)
    other = BatchReader(tmp_path, 32, shuffle_buffer_rows=50)
    other.set_epoch(1)
    same_batches(e1, list(other))
    assert all_rows(e0) != all_rows(e1) and reader.epoch == 2


def test_state_is_done_after_last_full_batch_with_drop_last(tmp_path):
    small_dataset(tmp_path)  # 300 rows: 9 batches of 32, 12 rows dropped
    reader = BatchReader(tmp_path, 32, ReadOptions(drop_last=True), shuffle_buffer_rows=50)
    it = iter(reader)
    for _ in range(8):
        next(it)
    assert not reader.state_dict()["epoch_done"]
    next(it)
    assert reader.state_dict()["epoch_done"] and reader.epoch == 1
    assert list(it) == [] and reader.counters["rows_dropped_last"] == 300 - 9 * 32


def test_load_state_dict_rejects_other_settings(tmp_path):
    small_dataset(tmp_path)
    state = BatchReader(tmp_path, 32, ReadOptions(seed=1)).state_dict()
    with pytest.raises(ConfigError, match="seed=1.*seed=2"):
        BatchReader(tmp_path, 32, ReadOptions(seed=2)).load_state_dict(state)
    with pytest.raises(ConfigError, match="world_size"):
        BatchReader(tmp_path, 32, ReadOptions(seed=1, shard=Shard(world_size=2))).load_state_dict(state)
    with pytest.raises(DataError, match="num_rows"):
        BatchReader(tmp_path, 32, ReadOptions(seed=1)).load_state_dict({**state, "num_rows": 5})
    with pytest.raises(ConfigError, match="position"):
        BatchReader(tmp_path, 32, ReadOptions(seed=1)).load_state_dict({**state, "row_offset": -1})


def test_memory_bounded_by_shuffle_buffer(tmp_path):
    schema = make_schema(1, [True], [100])
    buffer_rows, rg, batch = 1000, 100, 64
    write_parquet(
        tmp_path, schema, make_columns(schema, 10 * buffer_rows, 0), rows_per_row_group=rg, rows_per_file=3000
    )
    for ahead in (0, 1, 2):  # each buffer decoded ahead adds one buffer
        reader = BatchReader(tmp_path, batch, ReadOptions(read_ahead=ahead), shuffle_buffer_rows=buffer_rows)
        rows = sum(b.batch_size for b in reader)
        assert rows == 10 * buffer_rows
        most = (1 + ahead) * (buffer_rows + rg) + batch
        assert buffer_rows <= reader.counters["max_buffered_rows"] <= most
        plain = BatchReader(tmp_path, batch, ReadOptions(shuffle=False, read_ahead=ahead))
        assert sum(b.batch_size for b in plain) == rows
        assert plain.counters["max_buffered_rows"] <= (1 + ahead) * rg + batch


@pytest.mark.parametrize("shuffle", [True, False])
def test_read_ahead_changes_nothing_but_timing(tmp_path, shuffle):
    schema = small_dataset(tmp_path, n=400, rg=30)
    table = pq.read_table(tmp_path / "part-00001.parquet")
    ids = table.column("s0").to_numpy().copy()
    ids[::7] = 10_000  # out of range: repaired by the hash policy and counted
    pq.write_table(
        table.set_column(table.schema.get_field_index("s0"), "s0", pa.array(ids)),
        tmp_path / "part-00001.parquet",
        row_group_size=30,
    )
    runs = []
    for ahead in (0, 1, 3):
        opts = ReadOptions(shuffle=shuffle, seed=5, policies=Policies(invalid_ids="hash"), read_ahead=ahead)
        reader = BatchReader(tmp_path, 24, opts, shuffle_buffer_rows=70, schema=schema)
        out = list(reader.iter_with_state())
        stats = {k: v for k, v in reader.counters.items() if k != "max_buffered_rows"}
        for _, state in out:  # the memory high-water mark grows with read-ahead; nothing else does
            del state["counters"]["max_buffered_rows"]
        runs.append(([b for b, _ in out], [s for _, s in out], stats))
    for batches, states, stats in runs[1:]:
        same_batches(batches, runs[0][0])
        assert states == runs[0][1] and stats == runs[0][2]
    assert runs[0][2]["ids_hashed"] > 0
    with pytest.raises(ConfigError, match="read_ahead"):
        BatchReader(tmp_path, 8, ReadOptions(read_ahead=-1))


def test_abandoned_iteration_with_read_ahead_then_resume(tmp_path):
    small_dataset(tmp_path, n=300, rg=20)
    expected = list(BatchReader(tmp_path, 16, ReadOptions(seed=1, read_ahead=0), shuffle_buffer_rows=40))
    reader = BatchReader(tmp_path, 16, ReadOptions(seed=1, read_ahead=2), shuffle_buffer_rows=40)
    it = iter(reader)
    head = [next(it) for _ in range(5)]
    it.close()  # stops the worker thread and closes the files
    same_batches(head + list(reader), expected)


def test_column_projection(tmp_path):
    schema = small_dataset(tmp_path)
    cols = ["s2", "d1", "s1", "d0"]
    batches = list(BatchReader(tmp_path, 64, ReadOptions(shuffle=False), columns=cols))
    ref = reference_rows(tmp_path, schema, cols)  # schema order: d0, d1
    for k, batch in enumerate(batches):
        assert batch.dense.shape[1] == 2
        check_batch_equals_rows(batch, ref[k * 64 : (k + 1) * 64], ["s1", "s2"])  # schema order
    with pytest.raises(ConfigError, match="nope"):
        BatchReader(tmp_path, 64, columns=["nope"])


def test_from_config(tmp_path):
    small_dataset(tmp_path)
    cfg = DataConfig(batch_size=16, eval_batch_size=100, shuffle_buffer_rows=40, seed=3, drop_last=True)
    train = BatchReader.from_config(tmp_path, cfg, train=True)
    o = train.options
    assert (train.batch_size, o.shuffle, o.drop_last, o.seed) == (16, True, True, 3)
    ev = BatchReader.from_config(tmp_path, cfg, train=False)
    assert (ev.batch_size, ev.options.shuffle, ev.options.drop_last) == (100, False, False)
    assert all_rows(ev) == reference_rows(tmp_path, open_dataset(tmp_path).schema)
    with pytest.raises(ConfigError, match="invalid_ids"):
        BatchReader.from_config(tmp_path, DataConfig(invalid_ids="drop"), train=True)


# ---------------------------------------------------------------- bad files


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet: no such file"):
        BatchReader(tmp_path / "nope.parquet", 4)
    with pytest.raises(DataError, match=rf"{tmp_path}: directory has no \*\.parquet"):
        open_dataset(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncate_half", "truncate_tail"])
def test_unreadable_file_names_the_file(tmp_path, damage):
    small_dataset(tmp_path)
    victim = tmp_path / "part-00001.parquet"
    raw = victim.read_bytes()
    victim.write_bytes(
        {
            "garbage": b"not parquet at all" * 10,
            "truncate_half": raw[: len(raw) // 2],
            "truncate_tail": raw[:-3],
        }[damage]
    )
    with pytest.raises(DataError, match=r"part-00001\.parquet: cannot read Parquet footer"):
        BatchReader(tmp_path, 4)


def test_corrupted_page_names_file_and_row_group(tmp_path):
    small_dataset(tmp_path, per_file=None)
    victim = tmp_path / "part-00000.parquet"
    chunk = pq.ParquetFile(victim).metadata.row_group(2).column(1)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    raw = bytearray(victim.read_bytes())
    raw[start + chunk.total_compressed_size - 1] ^= 0xFF  # last byte of a page body
    victim.write_bytes(bytes(raw))
    reader = BatchReader(tmp_path, 10, ReadOptions(shuffle=False))  # footers are intact
    with pytest.raises(
        DataError, match=r"part-00000\.parquet, row group 2, column 'd0': cannot read row group.*CRC"
    ):
        list(reader)
    assert reader.counters["rows_yielded"] == 50  # row groups 0 and 1 came through


def test_files_with_different_schemas(tmp_path):
    a, b = make_schema(1, [False], [10]), make_schema(1, [False], [11])
    write_parquet(tmp_path, a, make_columns(a, 5, 0), prefix="a")
    write_parquet(tmp_path, b, make_columns(b, 5, 0), prefix="b")
    with pytest.raises(
        DataError, match=r"b-00000\.parquet: stored schema differs from that of .*a-00000\.parquet in: sparse"
    ):
        open_dataset(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.drop_columns(["s1"]), r"column 's1': column is missing"),
        (
            lambda t: t.set_column(3, "s0", pa.array([str(i) for i in range(t.num_rows)])),
            r"column 's0': column has type string",
        ),
        (
            lambda t: t.set_column(1, "d0", pa.array([[1.0]] * t.num_rows)),
            r"column 'd0': column has type list",
        ),
    ],
)
def test_missing_or_mistyped_column(tmp_path, change, message):
    schema = small_dataset(tmp_path, per_file=None)
    good = pq.read_table(tmp_path / "part-00000.parquet")
    bad = change(good).replace_schema_metadata({SCHEMA_METADATA_KEY: schema.to_json().encode()})
    pq.write_table(bad, tmp_path / "part-00001.parquet")
    with pytest.raises(DataError, match=r"part-00001\.parquet, " + message):
        open_dataset(tmp_path)


def test_empty_file_is_skipped_with_a_warning(tmp_path, caplog):
    schema = make_schema(1, [True], [10])
    write_parquet(tmp_path, schema, make_columns(schema, 0, 0), prefix="a")
    write_parquet(tmp_path, schema, make_columns(schema, 7, 0), prefix="b")
    with caplog.at_level(logging.WARNING, logger="recaccel"):
        info = open_dataset(tmp_path)
    assert "a-00000.parquet has no rows" in caplog.text
    assert len(info.files) == 2 and info.num_rows == 7
    assert all_rows(BatchReader(tmp_path, 3, ReadOptions(shuffle=False))) == reference_rows(tmp_path, schema)


# ---------------------------------------------------------------- bad values


def lists_dataset(tmp: Path, schema: FeatureSchema, cols: dict, rg: int = 10) -> None:
    """Writes python-list columns (None = null) as pyarrow arrays of the schema's types."""
    types = {f.name: f.type for f in schema.arrow_schema()}
    write_parquet(tmp, schema, {k: pa.array(v, types[k]) for k, v in cols.items()}, rows_per_row_group=rg)


def valid_lists(n: int = 30) -> dict:
    return {
        "label": [float(i % 2) for i in range(n)],
        "d0": [float(i) for i in range(n)],
        "d1": [0.5] * n,
        "s0": [i % 50 for i in range(n)],
        "s1": [[i % 20, (i + 1) % 20] for i in range(n)],
        "s2": [i % 7 for i in range(n)],
    }


@pytest.mark.parametrize(
    "column, value, message",
    [
        ("s0", -3, "invalid id -3 at row 4 (valid ids are 0..49)"),
        ("s0", 50, "invalid id 50 at row 4"),
        ("s0", None, "null id at row 4"),
        ("s1", [3, 20], "invalid id 20 at row 4 (valid ids are 0..19)"),
        ("s1", [3, None], "null id at row 4"),
        ("s1", None, "null list at row 4"),
        ("d1", math.nan, "invalid dense value nan at row 4"),
        ("d1", -math.inf, "invalid dense value -inf at row 4"),
        ("d1", None, "invalid dense value null at row 4"),
        ("label", 2.0, "invalid label 2.0 at row 4: not 0 or 1"),
        ("label", math.nan, "invalid label nan at row 4"),
        ("label", None, "invalid label null at row 4"),
    ],
)
def test_error_policy_names_file_row_group_column_value_row(tmp_path, column, value, message):
    schema = make_schema(2, [False, True, False], [50, 20, 7])
    cols = valid_lists()
    cols[column][14] = value  # row group 1 (10 rows each), row 4 inside it
    cols[column][27] = value  # a later one must not be the one reported
    lists_dataset(tmp_path, schema, cols)
    where = f"part-00000.parquet, row group 1, column '{column}': "
    with pytest.raises(DataError, match=re_escape(where + message)):
        list(BatchReader(tmp_path, 8, ReadOptions(shuffle=False)))


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_rating_labels_accept_any_finite_value(tmp_path):
    schema = FeatureSchema(dense=("d0",), sparse=(SparseField("s0", 5),), label_kind="rating")
    lists_dataset(tmp_path, schema, {"label": [3.5, -1.0, 4.0], "d0": [0.0] * 3, "s0": [1, 2, 3]})
    assert [b.labels.tolist() for b in BatchReader(tmp_path, 3, ReadOptions(shuffle=False))] == [
        [3.5, -1.0, 4.0]
    ]
    lists_dataset(tmp_path / "inf", schema, {"label": [3.5, math.inf], "d0": [0.0] * 2, "s0": [1, 2]})
    with pytest.raises(DataError, match="invalid label inf at row 1: not finite"):
        list(BatchReader(tmp_path / "inf", 3))


def expected_after_policies(rows: list[dict], schema: FeatureSchema, ids: str, dense: str, labels: str):
    """Plain-Python reference of the skip/clip/hash/zero policies and their counters."""
    out, stats = [], Counter()
    for r in rows:
        stats["rows_read"] += 1
        bad_label = r["label"] is None or not math.isfinite(r["label"]) or r["label"] not in (0.0, 1.0)
        bad_dense, dvals = False, []
        for d in schema.dense:
            v = r[d]
            if v is None or not math.isfinite(v):
                if dense == "zero":
                    v = 0.0
                    stats["dense_zeroed"] += 1
                else:
                    bad_dense = True
            dvals.append(v)
        bad_ids, bags = False, []
        for f in schema.sparse:
            items = r[f.name] if f.multi_hot else [r[f.name]]
            bag = []
            for x in items or []:
                if x is not None and not 0 <= x < f.cardinality:
                    if ids == "skip":
                        bad_ids = True
                    elif ids == "clip":
                        x = min(max(x, 0), f.cardinality - 1)
                        stats["ids_clipped"] += 1
                    else:
                        x = x % f.cardinality
                        stats["ids_hashed"] += 1
                bad_ids |= x is None
                bag.append(x)
            bad_ids |= items is None
            bags.append(tuple(bag))
        for bad, key in ((bad_label, "labels"), (bad_dense, "dense"), (bad_ids, "ids")):
            stats[f"rows_skipped_invalid_{key}"] += bad
        if bad_label or bad_dense or bad_ids:
            stats["rows_skipped"] += 1
        else:
            out.append((float(r["label"]), tuple(float(v) for v in dvals), tuple(bags)))
    return out, stats


def check_stats(reader: BatchReader, stats: Counter, rows_out: int) -> None:
    for key in (
        "rows_read",
        "rows_skipped",
        "rows_skipped_invalid_ids",
        "rows_skipped_invalid_dense",
        "rows_skipped_invalid_labels",
        "ids_clipped",
        "ids_hashed",
        "dense_zeroed",
    ):
        assert reader.counters[key] == stats[key], key
    assert reader.counters["rows_yielded"] == rows_out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 2**16),
    st.integers(0, 80),
    st.integers(1, 20),
    st.sampled_from(["skip", "clip", "hash"]),
    st.sampled_from(["skip", "zero"]),
    st.floats(0.0, 0.3),
)
def test_repair_policies_match_reference(seed, n, rg, ids, dense, p_bad):
    rng = np.random.default_rng(seed)
    schema = make_schema(2, [False, True, False], [int(c) for c in rng.integers(1, 30, 3)])
    bad = lambda: rng.random() < p_bad  # noqa: E731

    def some_id(card):
        return rng.choice([-1, -card - 5, card, card + 7, None]) if bad() else int(rng.integers(0, card))

    cols: dict = {
        "label": [
            rng.choice([2.0, math.nan, None, -1.0, math.inf]) if bad() else float(rng.integers(0, 2))
            for _ in range(n)
        ]
    }
    for d in schema.dense:
        cols[d] = [
            rng.choice([math.nan, math.inf, -math.inf, None]) if bad() else float(rng.normal())
            for _ in range(n)
        ]
    for f in schema.sparse:
        if f.multi_hot:
            cols[f.name] = [
                None if bad() else [some_id(f.cardinality) for _ in range(rng.integers(0, 4))]
                for _ in range(n)
            ]
        else:
            cols[f.name] = [some_id(f.cardinality) for _ in range(n)]
    cols = {
        k: [None if v is None else (int(v) if isinstance(v, np.integer) else v) for v in col]
        for k, col in cols.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        lists_dataset(Path(tmp), schema, cols, rg)
        reader = BatchReader(
            tmp,
            7,
            ReadOptions(
                shuffle=False, policies=Policies(invalid_ids=ids, invalid_dense=dense, invalid_labels="skip")
            ),
        )
        got = all_rows(reader)
        want, stats = expected_after_policies(pq.read_table(tmp).to_pylist(), schema, ids, dense, "skip")
        assert got == want
        check_stats(reader, stats, len(want))


@pytest.mark.parametrize("ids", ["skip", "clip", "hash"])
@pytest.mark.parametrize("dense", ["skip", "zero"])
def test_repair_policies_on_every_kind_of_bad_value(tmp_path, ids, dense):
    schema = make_schema(2, [False, True, False], [50, 20, 7])
    cols = valid_lists()
    bad = {
        ("s0", 1): -3,
        ("s0", 2): 50,
        ("s0", 3): -101,
        ("s0", 5): None,
        ("s1", 6): [3, 25, -2],
        ("s1", 7): None,
        ("s1", 8): [None, 4],
        ("s1", 9): [],
        ("s2", 11): 7,
        ("d0", 12): math.nan,
        ("d1", 13): math.inf,
        ("d1", 15): None,
        ("d0", 16): -math.inf,
        ("label", 17): 2.0,
        ("label", 18): None,
        ("label", 19): math.nan,
        ("s2", 21): -1,
        ("d0", 21): math.nan,
    }
    for (column, row), value in bad.items():
        cols[column][row] = value
    lists_dataset(tmp_path, schema, cols, rg=6)
    reader = BatchReader(
        tmp_path,
        4,
        ReadOptions(
            shuffle=False, policies=Policies(invalid_ids=ids, invalid_dense=dense, invalid_labels="skip")
        ),
    )
    got = all_rows(reader)
    want, stats = expected_after_policies(pq.read_table(tmp_path).to_pylist(), schema, ids, dense, "skip")
    assert got == want and len(want) < 30
    check_stats(reader, stats, len(want))
    if ids == "hash":
        assert (49,) in [row[2][0] for row in got]  # -101 mod 50, Python-style


def test_num_batches_matches_an_epoch(tmp_path):
    schema = FeatureSchema(("d",), (SparseField("c", 5),))
    rng = np.random.default_rng(0)
    cols = {
        "label": rng.integers(0, 2, 1003).astype(np.float32),
        "d": rng.random(1003).astype(np.float32),
        "c": rng.integers(0, 5, 1003),
    }
    write_parquet(tmp_path, schema, cols, rows_per_row_group=100)
    for drop_last in (True, False):
        reader = BatchReader(tmp_path, 64, ReadOptions(drop_last=drop_last), shuffle_buffer_rows=300)
        assert reader.num_batches == sum(1 for _ in reader)
