"""The reader's lean decode: int32 ids where the tables fit, one-hot batches without
offsets, dense float32 decoded once; checked against a per-row Python reference of
the bad-value policies, and a DLRM trained on the lean batches against the same
batches widened to int64 ids with explicit offsets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recaccel.config import load_config
from recaccel.errors import DataError
from recaccel.io.convert.synth import generate_synthetic
from recaccel.io.format.columns import Columns, take_batch
from recaccel.io.format.decode import Policies
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.host_buffer import layout_of, pack, unpack
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.shm_ring import flatten, unflatten
from recaccel.models.factory import build_model
from recaccel.sparse import Batch, SparseFeatures

EXACT = dict(rtol=0, atol=0)
BIG = 2**33  # a table beyond int32: its ids need int64


# ---------------------------------------------------------------- random data with bad values


def bad_dataset(tmp: Path, seed: int, *, big_table: bool = False, bad: bool = True) -> FeatureSchema:
    """A file of 3 row groups: 2 single-hot fields, 1 multi-hot (empty bags, null lists,
    null elements), 2 dense (float64, NaNs); with ``bad``, ids out of range and null ids."""
    rng = np.random.default_rng(seed)
    n = 300
    cards = [40, BIG if big_table else 7, 25]
    schema = FeatureSchema(
        dense=("d0", "d1"),
        sparse=(SparseField("a", cards[0]), SparseField("b", cards[1]), SparseField("m", cards[2], True)),
    )
    label = rng.integers(0, 2, n).astype(np.float32)
    dense = [rng.normal(size=n) * 10 for _ in range(2)]
    dense[1][rng.random(n) < 0.05] = np.nan
    a = rng.integers(0, cards[0], n).astype(object)
    b = rng.integers(0, min(cards[1], 2**40), n).astype(object)
    bags = [list(rng.integers(0, cards[2], rng.integers(0, 4))) for _ in range(n)]
    if bad:
        for i in rng.choice(n, 12, replace=False):
            a[i] = int(rng.choice([-3, cards[0], cards[0] + 17, -(2**40)]))
        for i in rng.choice(n, 4, replace=False):
            b[i] = None
        for i in rng.choice(n, 6, replace=False):
            bags[i] = None if i % 2 else [*(bags[i] or []), int(cards[2] + i), None]
    table = pa.table(
        {
            "label": pa.array(label, pa.float32()),
            "d0": pa.array(dense[0], pa.float64()),
            "d1": pa.array(dense[1], pa.float64()),
            "a": pa.array(list(a), pa.int64()),
            "b": pa.array(list(b), pa.int64()),
            "m": pa.array(bags, pa.list_(pa.int64())),
        }
    )
    tmp.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, tmp / "part-0.parquet", row_group_size=110)
    return schema


def reference(path: Path, schema: FeatureSchema, ids: str) -> list[tuple]:
    """Kept rows as (label, dense, bags), one row at a time in Python (dense policy zero)."""
    rows = []
    for r in pq.read_table(path).to_pylist():
        dense = tuple(0.0 if r[d] is None or not np.isfinite(r[d]) else r[d] for d in schema.dense)
        bags, keep = [], True
        for f in schema.sparse:
            bag = r[f.name] if f.multi_hot else [r[f.name]]
            if bag is None or None in bag:
                keep = False  # a null cannot be repaired under any policy
                break
            out = []
            for v in bag:
                if 0 <= v < f.cardinality:
                    out.append(v)
                elif ids == "clip":
                    out.append(min(max(v, 0), f.cardinality - 1))
                elif ids == "hash":
                    out.append(v % f.cardinality)
                else:
                    keep = False
            bags.append(tuple(out))
        if keep:
            rows.append((r["label"], tuple(np.float32(x) for x in dense), tuple(bags)))
    return rows


def batch_rows(batch: Batch) -> list[tuple]:
    sf = batch.sparse
    b, nf = batch.batch_size, sf.num_fields
    off, vals = sf.offsets.tolist(), sf.values.long().tolist()
    return [
        (
            float(batch.labels[i]),
            tuple(np.float32(x) for x in batch.dense[i].tolist()),
            tuple(tuple(vals[off[f * b + i] : off[f * b + i + 1]]) for f in range(nf)),
        )
        for i in range(b)
    ]


def read_all(path: Path, schema: FeatureSchema, ids: str, batch_size: int = 64, **opts) -> list[Batch]:
    policies = Policies(invalid_ids=ids, invalid_dense="zero")
    reader = BatchReader(path, batch_size, ReadOptions(policies=policies, **opts), schema=schema)
    return list(reader)


# ---------------------------------------------------------------- decode against the reference


@pytest.mark.parametrize("ids", ["skip", "clip", "hash"])
@pytest.mark.parametrize("seed", [0, 1])
def test_batches_match_a_per_row_reference_under_each_id_policy(tmp_path, ids, seed):
    schema = bad_dataset(tmp_path, seed)
    batches = read_all(tmp_path, schema, ids, shuffle=False)
    got = [row for batch in batches for row in batch_rows(batch)]
    assert got == reference(tmp_path / "part-0.parquet", schema, ids)
    for batch in batches:
        assert batch.sparse.values.dtype == torch.int32  # every table fits
        assert batch.dense.dtype == torch.float32 and batch.dense.is_contiguous()
        assert not batch.sparse.one_hot  # a multi-hot field keeps explicit int64 offsets
        assert batch.sparse.offsets.dtype == torch.int64


def test_error_policy_names_the_first_bad_row_and_clean_data_matches(tmp_path):
    schema = bad_dataset(tmp_path / "bad", 3)
    with pytest.raises(DataError, match=r"at row \d+"):
        read_all(tmp_path / "bad", schema, "error", shuffle=False)
    schema = bad_dataset(tmp_path / "clean", 3, bad=False)
    got = [
        row
        for batch in read_all(tmp_path / "clean", schema, "error", shuffle=False)
        for row in batch_rows(batch)
    ]
    assert got == reference(tmp_path / "clean" / "part-0.parquet", schema, "error")


def test_a_table_beyond_int32_makes_the_whole_batch_int64(tmp_path):
    schema = bad_dataset(tmp_path, 4, big_table=True)
    batches = read_all(tmp_path, schema, "hash", shuffle=True, seed=5)
    assert all(batch.sparse.values.dtype == torch.int64 for batch in batches)
    expected = sorted(reference(tmp_path / "part-0.parquet", schema, "hash"))
    assert sorted(row for batch in batches for row in batch_rows(batch)) == expected


def test_shuffled_batches_hold_the_same_rows_as_the_reference(tmp_path):
    schema = bad_dataset(tmp_path, 6)
    batches = read_all(tmp_path, schema, "clip", shuffle=True, seed=2)
    got = sorted(row for batch in batches for row in batch_rows(batch))
    assert got == sorted(reference(tmp_path / "part-0.parquet", schema, "clip"))


# ---------------------------------------------------------------- one-hot batches


def one_hot_dataset(tmp: Path) -> Path:
    cfg = load_config(
        None,
        [
            f'synth.out_dir="{tmp}"',
            "synth.train_rows=3000",
            "synth.test_rows=10",
            "synth.num_dense=3",
            "synth.num_sparse=4",
            "synth.cardinality=30",
            "synth.rows_per_row_group=700",
        ],
    )
    generate_synthetic(cfg.synth)
    return tmp / "train"


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_hot_batches_carry_int32_ids_and_no_offsets(tmp_path, shuffle):
    path = one_hot_dataset(tmp_path)
    batches = list(BatchReader(path, 256, ReadOptions(shuffle=shuffle, seed=1)))
    rows = sorted(row for batch in batches for row in batch_rows(batch))
    table = pq.read_table(path).to_pylist()
    schema = BatchReader(path, 1).schema
    expected = sorted(
        (
            r[schema.label],
            tuple(np.float32(r[d]) for d in schema.dense),
            tuple((r[f],) for f in schema.sparse_names),
        )
        for r in table
    )
    assert rows == expected
    for batch in batches:
        sf = batch.sparse
        assert sf.one_hot and sf.explicit_offsets is None and sf.values.dtype == torch.int32
        assert torch.equal(sf.offsets, torch.arange(sf.values.numel() + 1))  # made on first read
        assert sf.one_hot and sf.explicit_offsets is None  # still implicit for copies


def test_packing_a_one_hot_batch_sends_no_offsets_and_unpacks_one_hot(tmp_path):
    path = one_hot_dataset(tmp_path)
    batch = next(iter(BatchReader(path, 512, ReadOptions(shuffle=False))))
    wide = Batch(
        batch.dense,
        SparseFeatures(batch.sparse.keys, batch.sparse.values.long(), batch.sparse.offsets.clone()),
        batch.labels,
    )
    lean_bytes, wide_bytes = layout_of(batch).nbytes, layout_of(wide).nbytes
    f, b = batch.sparse.num_fields, batch.batch_size
    assert wide_bytes - lean_bytes >= 8 * (f * b + 1) + 4 * f * b - 64 * 3  # offsets gone, ids halved
    buf, layout = pack(batch)
    back = unpack(buf.clone(), layout)
    assert back.sparse.one_hot and torch.equal(back.sparse.values, batch.sparse.values)
    assert torch.equal(back.sparse.offsets, wide.sparse.offsets) and torch.equal(back.dense, batch.dense)


# ---------------------------------------------------------------- SparseFeatures with implicit offsets


def one_hot_pair(seed: int, f: int = 3, b: int = 5, weights: bool = True):
    """The same bags as (one-hot implicit, explicit int64) SparseFeatures."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, (f * b,), generator=g, dtype=torch.int32)
    w = torch.rand(f * b, generator=g) if weights else None
    keys = [f"k{i}" for i in range(f)]
    implicit = SparseFeatures(keys, values, None, w)
    explicit = SparseFeatures(keys, values.long(), torch.arange(f * b + 1), w)
    return implicit, explicit


def same(lean: SparseFeatures, ref: SparseFeatures) -> None:
    assert lean.keys == ref.keys and lean.batch_size == ref.batch_size
    assert torch.equal(lean.values.long(), ref.values.long())
    assert torch.equal(lean.offsets, ref.offsets) and torch.equal(lean.lengths(), ref.lengths())
    assert (lean.weights is None) == (ref.weights is None)
    if lean.weights is not None:
        assert torch.equal(lean.weights, ref.weights)


@pytest.mark.parametrize("weights", [True, False])
def test_implicit_offsets_give_the_results_of_explicit_ones(weights):
    lean, ref = one_hot_pair(0, weights=weights)
    same(lean, ref)
    same(lean.slice_rows(1, 4), ref.slice_rows(1, 4))
    same(lean.select(["k2", "k0"]), ref.select(["k2", "k0"]))
    same(lean.reorder(["k1", "k2", "k0"]), ref.reorder(["k1", "k2", "k0"]))
    other_lean, other_ref = one_hot_pair(1, b=2, weights=not weights)
    same(lean.concat_rows(other_lean), ref.concat_rows(other_ref))
    for got, want in zip(lean.field("k1"), ref.field("k1")):
        assert (got is None and want is None) or torch.equal(got.long(), want.long())
    assert lean.slice_rows(1, 4).one_hot and lean.select(["k2"]).one_hot


def test_implicit_offsets_are_made_only_when_read():
    lean, _ = one_hot_pair(4)
    moved = (
        lean.slice_rows(0, 3).to("cpu").pin_memory() if torch.cuda.is_available() else lean.slice_rows(0, 3)
    )
    for sf in (lean, moved, lean.select(["k1"]), lean.concat_rows(lean)):
        assert sf.batch_size > 0 and "_made" not in vars(sf)  # private: nothing made yet
    assert torch.equal(lean.offsets, torch.arange(16)) and "_made" in vars(lean)


def test_implicit_offsets_stay_implicit_through_to_and_are_made_on_the_device():
    lean, ref = one_hot_pair(2)
    moved = lean.to("meta")
    assert moved.one_hot and moved.explicit_offsets is None
    assert moved.offsets.device.type == "meta" and moved.offsets.shape == ref.offsets.shape
    back = lean.to("cpu")
    assert back.one_hot
    same(back, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_implicit_offsets_stay_implicit_through_pin_memory_and_cuda():
    lean, ref = one_hot_pair(3)
    pinned = lean.pin_memory()
    assert pinned.one_hot and pinned.values.is_pinned()
    dev = pinned.to("cuda", non_blocking=True)
    assert dev.one_hot and dev.offsets.is_cuda
    same(dev.to("cpu"), ref)


def test_one_hot_batches_stay_one_hot_through_shared_memory_and_reader_workers(tmp_path):
    lean, ref = one_hot_pair(5)
    assert lean.offsets.numel() == 16  # made here: what crosses must still be the implicit form
    skeleton, arrays = flatten(Batch(torch.zeros(5, 1), lean, torch.zeros(5)))
    back = unflatten(skeleton, arrays).sparse
    assert back.one_hot and len(arrays) == 4  # dense, labels, ids, weights: no offsets
    same(back, ref)
    path = one_hot_dataset(tmp_path)
    inline = list(BatchReader(path, 256, ReadOptions(shuffle=True, seed=4)))
    workers = list(BatchReader(path, 256, ReadOptions(shuffle=True, seed=4, workers=1)))
    assert len(inline) == len(workers)
    for a, b in zip(inline, workers):
        assert b.sparse.one_hot and b.sparse.values.dtype == torch.int32
        assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.dense, b.dense)


def test_implicit_offsets_refuse_ids_that_are_not_one_per_bag():
    with pytest.raises(ValueError, match="one id per bag"):
        SparseFeatures(["a", "b"], torch.arange(5), None)
    with pytest.raises(ValueError, match="at least one field"):
        SparseFeatures([], torch.arange(0), None)


# ---------------------------------------------------------------- training is unchanged


def widened(batch: Batch) -> Batch:
    """The batch as before: int64 ids and explicit int64 offsets."""
    sf = batch.sparse
    wide = SparseFeatures(sf.keys, sf.values.long(), sf.offsets.clone().long(), sf.weights)
    return Batch(batch.dense, wide, batch.labels, batch.weights)


def train_losses(path: Path, cfg, batches: list[Batch]) -> list[float]:
    torch.manual_seed(0)
    schema = BatchReader(path, 1).schema
    model = build_model(cfg.model, cfg.optim, schema, torch.device("cpu"))
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if "embedding" not in n], lr=0.01)
    losses = []
    for batch in batches:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch).squeeze(-1), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("multi_hot", [0, 2])
def test_training_on_lean_batches_gives_bit_identical_losses(tmp_path, multi_hot):
    cfg = load_config(
        "configs/debug.toml",
        [
            f'synth.out_dir="{tmp_path}"',
            "synth.train_rows=2048",
            "synth.test_rows=10",
            "synth.rows_per_row_group=512",
            f"synth.multi_hot_fields={multi_hot}",
        ],
    )
    generate_synthetic(cfg.synth)
    path = tmp_path / "train"
    batches = list(BatchReader(path, 256, ReadOptions(shuffle=True, seed=3)))
    assert all(b.sparse.one_hot == (multi_hot == 0) and b.sparse.values.dtype == torch.int32 for b in batches)
    lean = train_losses(path, cfg, batches)
    wide = train_losses(path, cfg, [widened(b) for b in batches])
    assert lean == wide and len(lean) == 8


@pytest.mark.parametrize("stored", [pa.int32(), pa.uint16(), pa.uint64(), pa.int8()])
def test_ids_of_any_stored_integer_type_decode_to_the_same_int32_batch(tmp_path, stored):
    rng = np.random.default_rng(7)
    n = 200
    schema = FeatureSchema(dense=("d0",), sparse=(SparseField("a", 100), SparseField("m", 50, True)))
    bags = [rng.integers(0, 50, rng.integers(0, 3)).tolist() for _ in range(n)]
    table = pa.table(
        {
            "label": pa.array(rng.integers(0, 2, n), pa.float32()),
            "d0": pa.array(rng.normal(size=n), pa.float32()),
            "a": pa.array(rng.integers(0, 100, n), stored),
            "m": pa.array(bags, pa.list_(stored)),
        }
    )
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=64)
    batches = read_all(tmp_path, schema, "error", shuffle=False)
    assert all(b.sparse.values.dtype == torch.int32 for b in batches)
    got = [row for batch in batches for row in batch_rows(batch)]
    assert got == reference(tmp_path / "part-0.parquet", schema, "error")


def test_wide_decoded_ids_are_narrowed_in_the_batch_copy_and_joined_parts_widen():
    rng = np.random.default_rng(9)
    n = 50

    def cols(dtype):
        ids = [rng.integers(0, 1000, n) for _ in range(2)]  # int64, as Arrow decodes them
        offsets = [np.arange(n + 1)] * 2
        dense, labels = rng.normal(size=(n, 2)).astype(np.float32), np.zeros(n, np.float32)
        return Columns(dense, labels, ["a", "b"], ids, offsets, id_dtype=dtype)

    narrow, wide = cols(np.int32), cols(np.int64)
    idx = rng.permutation(n)
    for rows in (slice(3, 40), idx):
        batch = take_batch(narrow, rows)
        assert batch.sparse.values.dtype == torch.int32 and batch.sparse.one_hot
        want = np.concatenate([v[rows] for v in narrow.values])
        assert np.array_equal(batch.sparse.values.numpy(), want)
    joined = Columns.concat([narrow, wide], row_major_ids=True)
    assert joined.id_dtype == np.int64 and joined.to_batch().sparse.values.dtype == torch.int64
    both = Columns.concat([narrow, cols(np.int32)], row_major_ids=True)
    assert both.ids.dtype == np.int32 and take_batch(both, idx).sparse.values.dtype == torch.int32
