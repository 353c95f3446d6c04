"""Parquet fuzzing: damaged files give one-line errors or exactly counted skips, never garbage.

One small valid task-keyed file is written with the project's writer, then damaged in a
seeded way: byte flips in data pages and in the footer, truncations and cut-outs, broken
``recaccel.schema`` metadata, changed column types, nulls and bad values. Each variant is
read whole with the :class:`BatchReader` (and, for some, the :class:`TaskReader`) under
the default ``error`` policy and under the ``skip`` policy. The contract:

- an error is a :class:`RecaccelError` whose message is one line naming the file, and the
  row group and column where the variant says which (bad values, nulls, types);
- otherwise every yielded batch is valid against the schema (ids below the cardinality,
  finite dense values, labels 0 or 1) and every row is one of the file's rows: a flip
  that decodes "successfully" must not change a value;
- under ``skip``, a variant with known bad rows yields exactly the other rows and counts
  exactly the bad ones;
- never another exception type, never a hang (each read runs under a deadline).

About 100 variants run in CI (a few seconds); ``RECACCEL_FUZZ_VARIANTS=2000`` (and
``RECACCEL_FUZZ_SEED``) runs a longer campaign.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recaccel.config import TasksConfig
from recaccel.errors import RecaccelError
from recaccel.io.format.decode import Policies
from recaccel.io.format.grouping import grouped_schema
from recaccel.io.format.schema import SCHEMA_METADATA_KEY, FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.tasks.reader import TaskReader

N_ROWS, ROWS_PER_GROUP, TASK_ROWS = 60, 20, 10
CARDS = {"rid": N_ROWS, "s1": 20, "s2": 7}  # rid: the row's number, so rows can be traced
DEADLINE_S = 60.0  # per read; generous for a loaded CI host, a hang still fails
VARIANTS = int(os.environ.get("RECACCEL_FUZZ_VARIANTS", "100"))
CAMPAIGN_SEED = int(os.environ.get("RECACCEL_FUZZ_SEED", "0"))
SKIP = dict(invalid_ids="skip", invalid_dense="skip", invalid_labels="skip")
TASK_EVERY = 3
TASKS = TasksConfig(tasks_per_batch=2, support_size=4, query_size=4, min_task_rows=1, shuffle_buffer_tasks=3)


# ---------------------------------------------------------------- the valid file


def base_schema() -> FeatureSchema:
    sparse = (
        SparseField("rid", CARDS["rid"]),
        SparseField("s1", CARDS["s1"], multi_hot=True),
        SparseField("s2", CARDS["s2"]),
    )
    return grouped_schema(FeatureSchema(dense=("d0", "d1"), sparse=sparse), "user", "ts")


def base_table(tmp: Path) -> pa.Table:
    """The valid dataset: N_ROWS rows, tasks of TASK_ROWS rows, row groups of ROWS_PER_GROUP."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, N_ROWS)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cols = {
        "label": rng.integers(0, 2, N_ROWS).astype(np.float32),
        "d0": rng.normal(size=N_ROWS).astype(np.float32),
        "d1": rng.normal(size=N_ROWS).astype(np.float32),
        "rid": np.arange(N_ROWS),
        "s1": (rng.integers(0, CARDS["s1"], int(offsets[-1])), offsets),
        "s2": rng.integers(0, CARDS["s2"], N_ROWS),
        "user": np.repeat(np.arange(N_ROWS // TASK_ROWS) * 3 + 1, TASK_ROWS),
        "ts": rng.integers(0, 100, N_ROWS),
    }
    (path,) = write_parquet(tmp / "base", base_schema(), cols, rows_per_row_group=ROWS_PER_GROUP)
    return pq.read_table(path)


def row_of(table_row: dict) -> tuple:
    """A row as (rid, label, dense, bags), from ``read_table().to_pylist()``."""
    return (
        table_row["rid"],
        float(table_row["label"]),
        (table_row["d0"], table_row["d1"]),
        (tuple(table_row["s1"]),),
        (table_row["s2"],),
    )


def batch_rows(batch) -> list[tuple]:
    """Rows of a Batch in :func:`row_of`'s form."""
    b = batch.batch_size
    off, vals = batch.sparse.offsets.tolist(), batch.sparse.values.tolist()
    bag = [[tuple(vals[off[f * b + i] : off[f * b + i + 1]]) for i in range(b)] for f in range(3)]
    dense, labels = batch.dense.tolist(), batch.labels.tolist()
    return [(bag[0][i][0], labels[i], tuple(dense[i]), (bag[1][i],), (bag[2][i][0],)) for i in range(b)]


# ---------------------------------------------------------------- variants


@dataclass
class Variant:
    """A damaged copy of the file and what reading it must give.

    Attributes:
        name: what was damaged (for failure messages).
        damage: writes the damaged file given the valid file's path and table.
        bad_rows: rids the ``skip`` policy must drop (None = not known in advance).
        columns: columns an error may name (empty = any); ``row_groups`` likewise.
        must_fail: the default policy must raise (values or schema are known to be bad).
        tasks_must_fail: the task reader must raise under any policy.
        where: what an error raised while iterating must name besides the file
            (``row_group``, ``column``).
        same_rows: a read that succeeds must give exactly the file's rows (False where
            the variant changes values on purpose, e.g. a cardinality in the metadata).
    """

    name: str
    damage: Callable[[Path, pa.Table, Path], None]
    bad_rows: set[int] | None = None
    columns: set[str] = field(default_factory=set)
    row_groups: set[int] = field(default_factory=set)
    must_fail: bool = False
    same_rows: bool = True
    tasks_must_fail: bool = False
    where: tuple[str, ...] = ()


def _flip(raw: bytes, pos: int, rng: np.random.Generator) -> bytes:
    out = bytearray(raw)
    out[pos] ^= int(rng.integers(1, 256))
    return bytes(out)


def page_flip(rng: np.random.Generator) -> Variant:
    rg, col = int(rng.integers(0, N_ROWS // ROWS_PER_GROUP)), int(rng.integers(0, 8))
    k = int(rng.integers(1, 3))

    def damage(src: Path, table: pa.Table, dst: Path) -> None:
        chunk = pq.ParquetFile(src).metadata.row_group(rg).column(col)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        raw = src.read_bytes()
        for _ in range(k):
            raw = _flip(raw, start + int(rng.integers(0, chunk.total_compressed_size)), rng)
        dst.write_bytes(raw)

    name = base_schema().arrow_schema().names[col]
    return Variant(
        f"page_flip(rg={rg}, col={name}, k={k})",
        damage,
        columns={name},
        row_groups={rg},
        where=("row_group", "column"),
    )


def footer_flip(rng: np.random.Generator) -> Variant:
    k = int(rng.integers(1, 3))

    def damage(src: Path, table: pa.Table, dst: Path) -> None:
        raw = src.read_bytes()
        footer = int.from_bytes(raw[-8:-4], "little") + 8
        for _ in range(k):
            raw = _flip(raw, len(raw) - footer + int(rng.integers(0, footer)), rng)
        dst.write_bytes(raw)

    return Variant(f"footer_flip(k={k})", damage)


def truncation(rng: np.random.Generator) -> Variant:
    cut_out = bool(rng.integers(0, 2))

    def damage(src: Path, table: pa.Table, dst: Path) -> None:
        raw = src.read_bytes()
        start = int(rng.integers(0, len(raw)))
        if cut_out:  # bytes removed from the middle: the footer's offsets point astray
            raw = raw[:start] + raw[start + int(rng.integers(1, 64)) :]
        else:
            raw = raw[:start]
        dst.write_bytes(raw)

    return Variant(f"{'cut_out' if cut_out else 'truncate'}", damage, must_fail=not cut_out)


def _rewrite(table: pa.Table, dst: Path, meta: bytes | None = None) -> None:
    if meta is not None:
        table = table.replace_schema_metadata({SCHEMA_METADATA_KEY: meta})
    pq.write_table(table, dst, row_group_size=ROWS_PER_GROUP, write_page_checksum=True)


def _schema_dict() -> dict:
    return json.loads(base_schema().to_json())


def _with_field(name: str, **changes) -> dict:
    raw = _schema_dict()
    raw["sparse"] = [{**f, **changes} if f["name"] == name else f for f in raw["sparse"]]
    return raw


SCHEMA_DAMAGE: dict[str, Callable[[], bytes]] = {
    "invalid_json": lambda: base_schema().to_json()[:-7].encode(),
    "not_utf8": lambda: b"\xff\xfe\xfa" + base_schema().to_json().encode(),
    "not_an_object": lambda: json.dumps(list(_schema_dict())).encode(),
    "missing_key": lambda: json.dumps({k: v for k, v in _schema_dict().items() if k != "sparse"}).encode(),
    "unknown_key": lambda: json.dumps({**_schema_dict(), "cardinality": 5}).encode(),
    "field_missing_key": lambda: json.dumps({**_schema_dict(), "sparse": [{"name": "rid"}]}).encode(),
    "string_cardinality": lambda: json.dumps(_with_field("s2", cardinality="7")).encode(),
    "float_cardinality": lambda: json.dumps(_with_field("s2", cardinality=7.5)).encode(),
    "zero_cardinality": lambda: json.dumps(_with_field("s2", cardinality=0)).encode(),
    "negative_cardinality": lambda: json.dumps(_with_field("s2", cardinality=-7)).encode(),
    "duplicate_names": lambda: json.dumps({**_schema_dict(), "dense": ["d0", "rid"]}).encode(),
    "label_kind": lambda: json.dumps({**_schema_dict(), "label_kind": "clicks"}).encode(),
    "list_as_dense": lambda: json.dumps({**_schema_dict(), "dense": "d0"}).encode(),
    "unknown_column": lambda: json.dumps({**_schema_dict(), "dense": ["d0", "d9"]}).encode(),
    "deep_nesting": lambda: b"[" * 50_000,
}


def schema_damage(rng: np.random.Generator) -> Variant:
    kinds = [*SCHEMA_DAMAGE, "random_edit"]
    kind = kinds[int(rng.integers(0, len(kinds)))]
    if kind != "random_edit":
        return Variant(
            f"schema:{kind}",
            lambda src, table, dst: _rewrite(table, dst, SCHEMA_DAMAGE[kind]()),
            must_fail=True,
        )
    text = bytearray(base_schema().to_json().encode())
    pos = int(rng.integers(0, len(text)))
    if rng.integers(0, 2):
        text[pos] ^= int(rng.integers(1, 128))
    else:
        del text[pos]
    # An edited cardinality may reject ids (error, or skipped rows of unknown count).
    return Variant(
        f"schema:random_edit(pos={pos})",
        lambda src, table, dst: _rewrite(table, dst, bytes(text)),
        same_rows=False,
    )


# Replacement columns: (name, make(table) -> array, compatible with the schema?)
TYPE_CHANGES: list[tuple[str, Callable[[pa.Table], pa.Array], bool]] = [
    ("label", lambda t: t["label"].cast(pa.string()), False),
    ("label", lambda t: t["label"].cast(pa.int64()), True),
    ("d0", lambda t: t["d0"].cast(pa.float64()), True),
    ("d0", lambda t: t["d0"].cast(pa.string()), False),
    ("d1", lambda t: pa.array([[v] for v in t["d1"].to_pylist()]), False),
    ("rid", lambda t: t["rid"].cast(pa.int32()), True),
    ("rid", lambda t: t["rid"].cast(pa.uint64()), True),
    ("rid", lambda t: t["rid"].cast(pa.float64()), False),
    ("rid", lambda t: t["rid"].cast(pa.string()), False),
    ("rid", lambda t: t["rid"].dictionary_encode(), True),  # a Parquet encoding: reads as int64
    ("s1", lambda t: t["s1"].cast(pa.large_list(pa.int64())), True),
    ("s1", lambda t: t["s1"].cast(pa.list_(pa.int32())), True),
    ("s1", lambda t: t["s1"].cast(pa.list_(pa.float64())), False),
    ("s1", lambda t: pa.array([len(v) for v in t["s1"].to_pylist()]), False),
    ("s2", lambda t: pa.array([[v] for v in t["s2"].to_pylist()]), False),
    ("user", lambda t: t["user"].cast(pa.float64()), False),
    ("ts", lambda t: t["ts"].cast(pa.string()), False),
]


def type_change(rng: np.random.Generator) -> Variant:
    j = int(rng.integers(0, len(TYPE_CHANGES)))
    name, make, compatible = TYPE_CHANGES[j]

    def damage(src: Path, table: pa.Table, dst: Path) -> None:
        i = table.schema.get_field_index(name)
        changed = table.set_column(i, name, make(table))
        _rewrite(changed, dst, table.schema.metadata[SCHEMA_METADATA_KEY])

    return Variant(
        f"type[{j}]:{name}",
        damage,
        bad_rows=set() if compatible else None,
        columns={name},
        must_fail=not compatible,
        where=("column",),
    )


# Bad values per column: (column, values to plant, whether the reader checks the column)
BAD_VALUES: dict[str, list] = {
    "label": [None, 2.0, -1.0, 0.5, math.nan, math.inf],
    "d0": [None, math.nan, math.inf, -math.inf],
    "d1": [None, math.nan, -math.inf],
    "rid": [None, -1, N_ROWS, 2**40],
    "s2": [None, -3, CARDS["s2"], 2**62],
    "s1": [None, [None], [1, None], [-1], [CARDS["s1"]], [3, 2**50]],
}


def _wide(t: pa.DataType) -> pa.DataType:
    """``t`` with its integers widened to int64."""
    if pa.types.is_list(t):
        return pa.list_(_wide(t.value_type))
    return pa.int64() if pa.types.is_integer(t) else t


def bad_values(rng: np.random.Generator) -> Variant:
    names = list(BAD_VALUES)
    picked = rng.choice(len(names), int(rng.integers(1, 3)), replace=False)
    plan: dict[str, dict[int, object]] = {}
    for j in picked:
        name = names[int(j)]
        rows = rng.choice(N_ROWS, int(rng.integers(1, 6)), replace=False)
        choices = BAD_VALUES[name]
        plan[name] = {int(r): choices[int(rng.integers(0, len(choices)))] for r in rows}

    def damage(src: Path, table: pa.Table, dst: Path) -> None:
        for name, rows in plan.items():
            values = table[name].to_pylist()
            for r, v in rows.items():
                values[r] = v
            i = table.schema.get_field_index(name)
            # int64 ids (as older recaccel and other tools write) hold the huge bad ids.
            table = table.set_column(i, name, pa.array(values, _wide(table.schema.field(name).type)))
        _rewrite(table, dst, table.schema.metadata[SCHEMA_METADATA_KEY])

    bad = {r for rows in plan.values() for r in rows}  # rid = row number
    shown = {n: sorted(r) for n, r in plan.items()}
    return Variant(
        f"values:{shown}",
        damage,
        bad_rows=bad,
        columns=set(plan),
        row_groups={r // ROWS_PER_GROUP for r in bad},
        must_fail=True,
        where=("row_group", "column"),
    )


def side_nulls(rng: np.random.Generator) -> Variant:
    """Nulls in the task key or timestamp: the BatchReader does not read them; the
    TaskReader must refuse them under any policy."""
    name = ["user", "ts"][int(rng.integers(0, 2))]
    row = int(rng.integers(0, N_ROWS))

    def damage(src: Path, table: pa.Table, dst: Path) -> None:
        values = table[name].to_pylist()
        values[row] = None
        i = table.schema.get_field_index(name)
        _rewrite(
            table.set_column(i, name, pa.array(values, pa.int64())),
            dst,
            table.schema.metadata[SCHEMA_METADATA_KEY],
        )

    return Variant(
        f"side_null:{name}[{row}]",
        damage,
        bad_rows=set(),
        columns={name},
        row_groups={row // ROWS_PER_GROUP},
        tasks_must_fail=True,
        where=("row_group", "column"),
    )


KINDS = [
    page_flip,
    page_flip,
    footer_flip,
    footer_flip,
    truncation,
    schema_damage,
    schema_damage,
    type_change,
    bad_values,
    bad_values,
    side_nulls,
]


def variant(i: int, seed: int) -> Variant:
    """Variant ``i`` of campaign ``seed``: its own RNG, so it is the same alone or in a run."""
    return KINDS[i % len(KINDS)](np.random.default_rng([seed, i]))


# ---------------------------------------------------------------- reading under a deadline


def run_with_deadline(read: Callable[[], object], what: str):
    """``read()``'s result or the RecaccelError it raised; fails on any other exception
    or when it takes longer than DEADLINE_S."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = read()
        except RecaccelError as e:
            box["error"] = e
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            box["other"] = "".join(traceback.format_exception(e))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        pytest.fail(f"{what}: still reading after {DEADLINE_S} s (a hang)")
    if "other" in box:
        pytest.fail(f"{what}: raised something other than a RecaccelError:\n{box['other']}")
    return box.get("result"), box.get("error")


def read_batches(path: Path, opened: list, **policy) -> tuple[list, dict]:
    reader = BatchReader(path, 8, ReadOptions(policies=Policies(**policy)), shuffle_buffer_rows=30)
    opened.append(True)
    return list(reader), dict(reader.counters)


def read_tasks(path: Path, opened: list, **policy) -> tuple[list, dict]:
    reader = TaskReader(
        path,
        dataclasses.replace(TASKS, unit_row_groups=1),
        ReadOptions(policies=Policies(**policy)),
        train=False,
    )
    opened.append(True)
    return list(reader), dict(reader.counters)


# ---------------------------------------------------------------- checks


def check_error(err: RecaccelError, path: Path, v: Variant, what: str, opened: bool) -> None:
    """One printable line naming the file; once the file is open (its footer read),
    also the row group and column the variant says."""
    msg = str(err)
    assert msg.isprintable(), f"{what}: error is not one printable line: {msg!r}"
    assert f"file {path}" in msg, f"{what}: error does not name the file: {msg!r}"
    for attr in v.where if opened else ():
        assert getattr(err, attr, None) is not None, f"{what}: error does not name the {attr}: {msg}"
    if v.columns and getattr(err, "column", None) is not None:
        assert err.column in v.columns, f"{what}: error names column {err.column!r}: {msg}"
    if v.row_groups and getattr(err, "row_group", None) is not None:
        assert err.row_group in v.row_groups, f"{what}: error names row group {err.row_group}: {msg}"


def check_batch_valid(batch, what: str) -> None:
    """Values within the schema's bounds and well-formed CSR."""
    b = batch.batch_size
    assert batch.sparse.keys == ["rid", "s1", "s2"], what
    assert batch.dense.shape == (b, 2), what
    assert bool(torch.isfinite(batch.dense).all()), f"{what}: dense not finite"
    assert bool(((batch.labels == 0) | (batch.labels == 1)).all()), f"{what}: labels not 0/1: {batch.labels}"
    off = batch.sparse.offsets
    assert off.shape == (3 * b + 1,) and off[0] == 0 and off[-1] == batch.sparse.values.numel(), what
    assert bool((off[1:] >= off[:-1]).all()), f"{what}: offsets decrease"
    for f, name in enumerate(batch.sparse.keys):
        ids = batch.sparse.values[off[f * b] : off[(f + 1) * b]]
        assert bool(((ids >= 0) & (ids < CARDS[name])).all()), f"{what}: {name} has ids outside the table"
        if name != "s1":  # single-hot: one id per row
            assert bool((off[f * b + 1 : (f + 1) * b + 1] - off[f * b : (f + 1) * b] == 1).all()), what


def check_batches(batches: list, stats: dict, rows: dict, v: Variant, what: str, skipping: bool) -> None:
    for batch in batches:
        check_batch_valid(batch, what)
    got = [r for batch in batches for r in batch_rows(batch)]
    assert stats["rows_read"] - stats["rows_skipped"] == len(got) == stats["rows_yielded"], what
    if v.same_rows:
        unknown = [r for r in got if rows.get(r[0]) != r]
        assert not unknown, f"{what}: rows that are not in the file: {unknown[:3]}"
        assert len({r[0] for r in got}) == len(got), f"{what}: a row came twice"
        if stats["rows_skipped"] == 0:
            assert len(got) == N_ROWS, f"{what}: {N_ROWS - len(got)} rows missing"
    if v.bad_rows is not None and skipping:
        assert sorted(r[0] for r in got) == sorted(set(rows) - v.bad_rows), f"{what}: wrong rows kept"
        assert stats["rows_skipped"] == len(v.bad_rows), f"{what}: {stats}"
    elif v.bad_rows is not None:
        assert not v.bad_rows and len(got) == N_ROWS, what


def check_task_batches(batches: list, stats: dict, rows: dict, v: Variant, what: str) -> list[int]:
    """Checks every TaskBatch's rows (padding included) against the schema, and its real
    rows against the file: each at most once, unchanged, all of them when none was
    skipped. Returns the rids of the real rows."""
    rids = []
    for tb in batches:
        for side, mask in ((tb.support, tb.support_mask), (tb.query, tb.query_mask)):
            check_batch_valid(side, what)
            real = [r for r, m in zip(batch_rows(side), mask.reshape(-1).tolist()) if m > 0]
            if v.same_rows:
                assert all(rows.get(r[0]) == r for r in real), f"{what}: rows that are not in the file"
            rids += [r[0] for r in real]
    assert len(set(rids)) == len(rids), f"{what}: a row came twice"
    if v.same_rows and stats["rows_skipped"] == 0:
        assert sorted(rids) == sorted(rows), f"{what}: {N_ROWS - len(rids)} rows missing"
    return rids


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> tuple[Path, pa.Table, dict]:
    tmp = tmp_path_factory.mktemp("fuzz")
    table = base_table(tmp)
    (src,) = sorted((tmp / "base").glob("*.parquet"))
    return src, table, {r["rid"]: row_of(r) for r in table.to_pylist()}


def test_the_valid_file_reads_back_exactly(valid_file):
    src, _, rows = valid_file
    ok = Variant("none", lambda *a: None, bad_rows=set())
    for policy in ({}, SKIP):
        batches, stats = read_batches(src, [], **policy)
        check_batches(batches, stats, rows, ok, "valid file", skipping=bool(policy))
    assert len(check_task_batches(*read_tasks(src, []), rows, ok, "valid file")) == N_ROWS


def check_variant(
    i: int, seed: int, src: Path, table: pa.Table, rows: dict, tmp: Path, tasks: bool | None = None
) -> None:
    """Damages a copy of the file as variant ``i`` of campaign ``seed`` says and reads it
    whole with the batch reader under both policies, and with the task reader (under one
    of them) when ``tasks`` (None: for every TASK_EVERY-th variant)."""
    v = variant(i, seed)
    dst = tmp / f"v{i:05d}.parquet"
    v.damage(src, table, dst)
    what = f"variant {i} (seed {seed}) {v.name}"
    for policy in ({}, SKIP):
        label = f"{what}, {'skip' if policy else 'error'} policy"
        opened: list = []
        result, err = run_with_deadline(
            lambda opened=opened, policy=policy: read_batches(dst, opened, **policy), label
        )
        if err is not None:
            check_error(err, dst, v, label, bool(opened))
            continue
        assert not (v.must_fail and not policy), f"{label}: read without an error"
        check_batches(*result, rows, v, label, skipping=bool(policy))
    if not (i % TASK_EVERY == 0 if tasks is None else tasks):  # the task reader costs more
        return
    policy = SKIP if i % 2 else {}
    label, opened = f"{what}, task reader, {'skip' if policy else 'error'} policy", []
    result, err = run_with_deadline(lambda: read_tasks(dst, opened, **policy), label)
    if err is not None:
        check_error(err, dst, v, label, bool(opened))
        return
    assert not v.tasks_must_fail and not (v.must_fail and (v.bad_rows is None or not policy)), (
        f"{label}: read without an error"
    )
    rids = check_task_batches(*result, rows, v, label)
    if v.bad_rows is not None:
        assert sorted(rids) == sorted(set(rows) - v.bad_rows), f"{label}: wrong rows kept, {result[1]}"


CHUNKS = max(1, VARIANTS // 25)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_damaged_files_give_one_line_errors_or_valid_batches(valid_file, tmp_path, chunk):
    src, table, rows = valid_file
    for i in range(chunk, VARIANTS, CHUNKS):
        check_variant(i, CAMPAIGN_SEED, src, table, rows, tmp_path)


# Variants that broke the readers once: (seed, index, what went wrong).
REGRESSIONS = [
    (0, 3611, "footer flip: pyarrow aborted the process as the task reader read column statistics"),
    (5, 487, "footer flip: a row group's negative row count made its rows vanish"),
]


@pytest.mark.parametrize("seed, index, what", REGRESSIONS, ids=[f"{s}-{i}" for s, i, _ in REGRESSIONS])
def test_variants_that_once_broke_the_readers(valid_file, tmp_path, seed, index, what):
    src, table, rows = valid_file
    check_variant(index, seed, src, table, rows, tmp_path, tasks=True)


def _flip_page_body(src: Path, table: pa.Table, dst: Path) -> None:
    chunk = pq.ParquetFile(src).metadata.row_group(1).column(3)  # row group 1 of rid
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    raw = bytearray(src.read_bytes())
    raw[start + chunk.total_compressed_size - 1] ^= 0x55  # the last page's last byte
    dst.write_bytes(bytes(raw))


def _bad_label(src: Path, table: pa.Table, dst: Path) -> None:
    labels = table["label"].to_pylist()
    labels[45] = 3.0  # row group 2
    _rewrite(
        table.set_column(0, "label", pa.array(labels, pa.float32())),
        dst,
        table.schema.metadata[SCHEMA_METADATA_KEY],
    )


def _metadata(make: Callable[[], bytes]) -> Callable[[Path, pa.Table, Path], None]:
    return lambda src, table, dst: _rewrite(table, dst, make())


def _huge_cardinality() -> bytes:
    return json.dumps(_with_field("s2", cardinality=10**12)).encode()


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            _metadata(SCHEMA_DAMAGE["zero_cardinality"]),
            r": bad recaccel\.schema metadata: sparse field 's2' has cardinality 0",
        ),
        (_metadata(SCHEMA_DAMAGE["invalid_json"]), r": bad recaccel\.schema metadata: not valid JSON"),
        (
            _metadata(_huge_cardinality),
            r": the embedding tables of the schema need .* \(16000000001280 bytes: .*'s2': 1000000000000 ids",
        ),
        (_flip_page_body, r", row group 1, column 'rid': cannot read row group: .*CRC"),
        (_bad_label, r", row group 2, column 'label': invalid label 3\.0 at row 5"),
    ],
    ids=["zero_cardinality", "invalid_json", "huge_cardinality", "page_flip", "bad_label"],
)
def test_training_on_a_damaged_file_exits_2_with_one_line(valid_file, tmp_path, capsys, damage, message):
    from recaccel.cli import train_main

    src, table, _ = valid_file
    bad = tmp_path / "bad.parquet"
    damage(src, table, bad)
    sets = [
        f'data.train="{bad}"',
        f'data.test="{src}"',
        f'train.out_dir="{tmp_path / "run"}"',
        "train.progress=false",
        "train.epochs=1",
        "data.batch_size=8",
        "data.shuffle=false",
        "model.embedding_dim=4",
        "model.bottom_mlp=[4]",
        "model.top_mlp=[4, 1]",
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.fullmatch(rf"recaccel-train: error: file {re.escape(str(bad))}{message}.*\n", err), err
