"""`recaccel-data tasks` on any Parquet through [data.schema]: string task keys, string
categoricals, a timestamp, out-of-core sorting, one-line errors, and meta training on
the result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from recaccel.cli import data_main, train_main
from recaccel.io.format.grouping import GROUPED_KEY, task_id
from recaccel.io.format.id_hash import hash_strings
from recaccel.io.format.schema import FeatureSchema

CITIES = ["paris", "lyon", "oslo", "rome", "kyiv", "lima", "pune", "cork"]

SCHEMA_TOML = """
[data.schema]
label = "click"
dense = ["price"]
task_key = "user"
timestamp = "ts"

[data.schema.sparse]
city = {hash = 64}
item = {hash = 128}
"""


def _foreign_rows(users: range, seed: int) -> pa.Table:
    """Clicks of users with a per-user click bias, written as plain pyarrow would: string
    user and city columns, a microsecond timestamp, rows in arrival (not task) order."""
    rng = np.random.default_rng(seed)
    per_user = rng.integers(14, 30, len(users))
    uid = np.repeat(np.array(users), per_user)
    n = uid.size
    perm = rng.permutation(n)  # interleave the users, as a log would
    uid = uid[perm]
    bias = (uid % 2) * 2.0 - 1.0  # half the users click, half do not: support rows tell which
    price = rng.normal(size=n)
    click = (rng.random(n) < 1 / (1 + np.exp(-(2.0 * bias + 0.5 * price)))).astype(np.int8)
    ts = rng.permutation(10**6)[:n]  # distinct: a row is known by (user, time)
    return pa.table(
        {
            "click": pa.array(click),
            "price": pa.array(price),
            "city": pa.array([CITIES[i] for i in rng.integers(0, len(CITIES), n)]),
            "item": pa.array(rng.integers(0, 10**9, n)),
            "user": pa.array([f"user-{u:03d}" for u in uid]),
            "ts": pa.array(ts, pa.timestamp("us")),
            "note": pa.array(["unmapped"] * n),  # a column the mapping ignores
        }
    )


def _write_foreign(folder: Path, table: pa.Table, rows_per_group: int = 97) -> Path:
    folder.mkdir(parents=True)
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), folder / "a.parquet", row_group_size=rows_per_group)
    pq.write_table(table.slice(half), folder / "b.parquet", row_group_size=rows_per_group)
    return folder


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("foreign")
    config = root / "schema.toml"
    config.write_text(SCHEMA_TOML)
    train = _write_foreign(root / "raw_train", _foreign_rows(range(0, 40), 0))
    test = _write_foreign(root / "raw_test", _foreign_rows(range(40, 56), 1))
    return train, test, config


def _group(src: Path, out: Path, config: Path, capsys, *extra: str) -> dict:
    assert data_main(["tasks", str(src), str(out), "--config", str(config), *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _read_dir(folder: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("*.parquet")))


def test_foreign_parquet_with_string_keys_is_grouped_by_hashed_task_then_time(foreign, tmp_path, capsys):
    src, _, config = foreign
    report = _group(src, tmp_path / "out", config, capsys)
    raw = _read_dir(src)
    out = _read_dir(tmp_path / "out")
    assert report["rows"] == raw.num_rows == out.num_rows
    assert report["tasks"] == len(set(raw.column("user").to_pylist())) == 40
    # Each row's task id is its user's 63-bit string hash; rows sorted by (task, time).
    raw_ts = raw.column("ts").cast(pa.int64()).to_numpy()
    expected = sorted(zip((task_id(u) for u in raw.column("user").to_pylist()), raw_ts))
    got = list(zip(out.column("user").to_numpy(), out.column("ts").to_numpy()))
    assert got == expected
    # String categoricals hashed exactly as training's mapping hashes them.
    rows = {
        (task_id(u), t): c for u, t, c in zip(raw.column("user").to_pylist(), raw_ts, raw["city"].to_pylist())
    }
    cities = [rows[(k, t)] for k, t in got]
    np.testing.assert_array_equal(out.column("city").to_numpy(), hash_strings(pa.array(cities), 64))
    # The output is a recaccel dataset that says how to find a task back from its key.
    first = next((tmp_path / "out").glob("*.parquet"))
    schema = FeatureSchema.from_arrow(pq.read_schema(first), str(first))
    assert schema.extra[GROUPED_KEY] == {"task_key": "user", "timestamp": "ts", "key_hash": "string63"}
    assert "note" not in out.column_names
    # task_keys.csv beside the files leads from a task id back to its key.
    keys = pa_csv.read_csv(report["task_keys"])
    users = sorted(set(raw.column("user").to_pylist()), key=task_id)
    assert keys.column("key").to_pylist() == users
    assert keys.column("task_id").to_pylist() == [task_id(u) for u in users]


def test_tiny_memory_limit_spills_runs_and_writes_what_an_in_memory_sort_writes(foreign, tmp_path, capsys):
    src, _, config = foreign
    small = _group(src, tmp_path / "small", config, capsys, "--memory", "100")
    large = _group(src, tmp_path / "large", config, capsys, "--memory", "1000000")
    rows = small["rows"]
    assert large["runs"] == 0 and large["max_rows_in_memory"] == rows
    # The data is many times the limit: runs of at most 100 rows are spilled (one source
    # row group of 97 rows each here) and merged in passes that never hold more than 100.
    assert rows > 8 * 100 and small["runs"] == -(-rows // 97) + 1  # 2 files, 2 short tails
    assert 0 < small["max_rows_in_memory"] <= 100
    assert _read_dir(tmp_path / "small").equals(_read_dir(tmp_path / "large"))


def test_grouped_foreign_data_trains_in_meta_mode(foreign, tmp_path, capsys):
    src, test_src, config = foreign
    _group(src, tmp_path / "train", config, capsys)
    _group(test_src, tmp_path / "test", config, capsys)
    out = tmp_path / "run"
    sets = [
        f'data.train="{tmp_path / "train"}"',
        f'data.test="{tmp_path / "test"}"',
        f'train.out_dir="{out}"',
        "train.progress=false",
        "train.mode=meta",
        "train.steps=12",
        "tasks.tasks_per_batch=8",
        "tasks.support_size=12",
        "tasks.query_size=8",
        "tasks.min_task_rows=6",
        "model.embedding_dim=8",
        "model.bottom_mlp=[8]",
        "model.top_mlp=[16, 1]",
        "meta.inner_lr=0.1",
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 12 and metrics["tasks"] == 16
    assert 0.0 <= metrics["auc"] <= 1.0


@pytest.mark.parametrize(
    ("toml_edit", "column"),
    [
        (("city = {hash = 64}", "cty = {hash = 64}"), "cty"),  # no such column
        (('dense = ["price"]', 'dense = ["city"]'), "city"),  # strings as a dense feature
        (('timestamp = "ts"', 'timestamp = "price"'), "price"),  # a float as timestamp
    ],
)
def test_bad_schema_is_one_line_naming_the_column_and_exit_2(foreign, tmp_path, capsys, toml_edit, column):
    src, _, config = foreign
    bad = tmp_path / "bad.toml"
    bad.write_text(config.read_text().replace(*toml_edit))
    assert data_main(["tasks", str(src), str(tmp_path / "out"), "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recaccel-data: error:") and "\n" not in err
    assert column in err
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_without_a_task_key_the_command_says_which_flag_to_give(foreign, tmp_path, capsys):
    src, _, config = foreign
    no_key = tmp_path / "nokey.toml"
    no_key.write_text(config.read_text().replace('task_key = "user"\n', ""))
    assert data_main(["tasks", str(src), str(tmp_path / "out"), "--config", str(no_key)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--task-key" in err and "\n" not in err


def test_task_id_of_an_integer_key_is_the_key():
    assert task_id(17) == 17
    assert 0 <= task_id("user-001") < 2**63 and task_id("user-001") != task_id("user-002")


def test_training_on_ungrouped_string_keys_says_to_group_them_first(foreign, tmp_path, capsys):
    src, test_src, config = foreign
    sets = [
        f'data.train="{src}"',
        f'data.test="{test_src}"',
        f'train.out_dir="{tmp_path / "run"}"',
        "train.mode=meta",
        "train.steps=2",
    ]
    argv = ["--config", str(config), *(a for s in sets for a in ("--set", s))]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "column 'user'" in err and "recaccel-data tasks" in err
