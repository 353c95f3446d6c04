"""MeLU's data generation reproduced: the 13..100 ratings filter, 10 fixed random query
ratings per user, validation users carved from warm_state.

A small synthetic fixture in MeLU's file format; the real files only for the per-state
counts (skipped where ../shared/data is absent).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recaccel.config import TasksConfig
from recaccel.errors import ConfigError
from recaccel.io.convert.melu import RANK_COLUMN, STATES, convert_melu
from recaccel.io.format.dataset import open_dataset
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.tasks.reader import TaskReader

# Ratings per user of the fixture: below 13, the edges 13 and 100, above 100.
SIZES = {1: 5, 2: 12, 3: 13, 4: 40, 5: 100, 6: 101, 7: 150, 8: 27}
KEPT = [3, 4, 5, 8]
NUM_MOVIES = 160

VOCABS = {
    "rate": ["G", "PG", "R"],
    "genre": ["Drama", "Comedy", "Horror"],
    "director": ["Ann Lee", "Bo Kim"],
    "actor": ["Cy Park", "Di Moon", "Ed Fox"],
    "gender": ["F", "M"],
    "age": ["1", "18", "25"],
    "occupation": ["0", "1", "2"],
    "zipcode": ["10001", "20002"],
}


def _write_fixture(root: Path) -> dict[str, tuple[dict, dict]]:
    """MeLU-format files; returns each state's (movie ids, ratings) JSON objects."""
    root.mkdir()
    for attr, values in VOCABS.items():
        (root / f"m_{attr}.txt").write_text("\n".join(values) + "\n", encoding="utf-8")
    users = [
        f"{u}::{'FM'[u % 2]}::{('1', '18', '25')[u % 3]}::{u % 3}::{('10001', '20002')[u % 2]}-12"
        for u in SIZES
    ]
    (root / "users.dat").write_text("\n".join(users) + "\n")
    movies = [
        f"{m}::T{m}::1999::{VOCABS['rate'][m % 3]}::1 Jan 1999::Drama, Comedy::Ann Lee (co-director)"
        f"::W::Cy Park, Di Moon::plot::url"
        for m in range(1, NUM_MOVIES + 1)
    ]
    (root / "movies_extrainfos.dat").write_text("\n".join(movies) + "\n", encoding="utf-8")
    rng = np.random.default_rng(7)
    states = {}
    for i, state in enumerate(STATES):
        x, y = {}, {}
        for u, n in SIZES.items():
            x[str(u)] = [str(m) for m in rng.choice(np.arange(1, NUM_MOVIES + 1), n, replace=False)]
            y[str(u)] = [int(r) for r in rng.integers(1, 6, n)]
        if i > 0:  # states differ in their users
            x.pop("8"), y.pop("8")
        (root / f"{state}.json").write_text(json.dumps(x))
        (root / f"{state}_y.json").write_text(json.dumps(y))
        states[state] = (x, y)
    return states


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("melu_protocol") / "src"
    return root, _write_fixture(root)


def _read(out: Path, state: str) -> dict[str, list]:
    cols = ["user", "item_id", "label", RANK_COLUMN]
    return pq.read_table(sorted((out / state).glob("*.parquet")), columns=cols).to_pydict()


def _expected_split(x: dict, y: dict, uid: int, seed: int) -> tuple[list, list]:
    """MeLU's data_generation.py with ``random.shuffle`` replaced by the seeded permutation:
    support = indices[:-10], query = indices[-10:], as (movie id, rating) pairs."""
    movies, ratings = x[str(uid)], y[str(uid)]
    indices = np.random.default_rng([seed, uid]).permutation(len(movies))
    pairs = [(int(movies[i]), float(ratings[i])) for i in indices]
    return pairs[:-10], pairs[-10:]


def test_melu_protocol_filters_users_and_counts_exactly(fixture, tmp_path):
    src, states = fixture
    report = convert_melu(src, tmp_path / "o", protocol="melu", include_ids=True)
    assert (report.min_ratings, report.max_ratings, report.query_count) == (13, 100, 10)
    for state, (x, _) in states.items():
        kept = [u for u in KEPT if str(u) in x]
        assert report.users[state] == len(kept)
        assert report.rows[state] == sum(SIZES[u] for u in kept)
        assert report.query_rows[state] == 10 * len(kept)
        assert report.users_below[state] == 2  # 5 and 12 ratings
        assert report.users_above[state] == 2  # 101 and 150 ratings
        assert report.users_filtered[state] == 4
        data = _read(tmp_path / "o", state)
        assert sorted(set(data["user"])) == kept
    schema = open_dataset(tmp_path / "o" / "warm_state").schema
    assert schema.timestamp == RANK_COLUMN


@pytest.mark.parametrize("seed", [0, 3])
def test_query_set_is_melus_seeded_shuffle(fixture, tmp_path, seed):
    src, states = fixture
    convert_melu(src, tmp_path / "o", protocol="melu", include_ids=True, seed=seed)
    x, y = states["warm_state"]
    data = _read(tmp_path / "o", "warm_state")
    rows = defaultdict(list)
    for u, m, r, k in zip(data["user"], data["item_id"], data["label"], data[RANK_COLUMN]):
        rows[u].append((k, (m, r)))
    for u in KEPT:
        ranks = [k for k, _ in rows[u]]
        assert ranks == list(range(SIZES[u]))  # stored in MeLU's shuffled order
        support, query = _expected_split(x, y, u, seed)
        got = [p for _, p in rows[u]]
        assert got[:-10] == support and got[-10:] == query


def test_seed_changes_the_query_sets(fixture, tmp_path):
    src, _ = fixture
    a = convert_melu(src, tmp_path / "a", protocol="melu", include_ids=True, seed=0)
    b = convert_melu(src, tmp_path / "b", protocol="melu", include_ids=True, seed=1)
    assert a.rows == b.rows
    da, db = _read(tmp_path / "a", "warm_state"), _read(tmp_path / "b", "warm_state")
    assert sorted(zip(da["user"], da["item_id"])) == sorted(zip(db["user"], db["item_id"]))
    assert da["item_id"] != db["item_id"]
    again = convert_melu(src, tmp_path / "c", protocol="melu", include_ids=True, seed=0)
    assert _read(tmp_path / "c", "warm_state") == da and again.rows == a.rows


@pytest.mark.parametrize("train", [False, True])
def test_task_reader_reads_exactly_the_fixed_split(fixture, tmp_path, train):
    src, states = fixture
    convert_melu(src, tmp_path / "o", protocol="melu", include_ids=True, seed=5)
    x, y = states["warm_state"]
    cfg = TasksConfig(
        tasks_per_batch=3, support_size=90, query_size=10, min_task_rows=13, split="time", query_count=10
    )
    reader = TaskReader(tmp_path / "o" / "warm_state", cfg, ReadOptions(seed=11), train=train)
    seen = {}
    for epoch in range(2 if train else 1):
        if train:
            reader.set_epoch(epoch)
        for tb in reader:
            s_ids = tb.support.sparse.field("item_id")[0].view(tb.support_mask.shape)
            q_ids = tb.query.sparse.field("item_id")[0].view(tb.query_mask.shape)
            s_lab = tb.support.labels.view(tb.support_mask.shape)
            q_lab = tb.query.labels.view(tb.query_mask.shape)
            for t, key in enumerate(tb.task_ids.tolist()):
                sm, qm = tb.support_mask[t].bool(), tb.query_mask[t].bool()
                support = sorted(zip(s_ids[t][sm].tolist(), s_lab[t][sm].tolist()))
                query = sorted(zip(q_ids[t][qm].tolist(), q_lab[t][qm].tolist()))
                assert seen.setdefault(key, (support, query)) == (support, query)  # same every epoch
    assert sorted(seen) == KEPT
    for u in KEPT:
        support, query = _expected_split(x, y, u, 5)
        assert seen[u] == (sorted(support), sorted(query))


def test_valid_fraction_carves_seeded_warm_users(fixture, tmp_path):
    src, states = fixture
    report = convert_melu(src, tmp_path / "o", protocol="melu", include_ids=True, valid_fraction=0.25)
    assert report.users["warm_state_valid"] == 1 and report.users["warm_state_train"] == 3
    assert report.rows["warm_state_valid"] + report.rows["warm_state_train"] == report.rows["warm_state"]
    warm = _read(tmp_path / "o", "warm_state")
    valid, train = _read(tmp_path / "o", "warm_state_valid"), _read(tmp_path / "o", "warm_state_train")
    assert not set(valid["user"]) & set(train["user"])
    assert set(valid["user"]) | set(train["user"]) == set(KEPT)
    for part in (valid, train):  # rows (and their split) as in warm_state
        users = set(part["user"])
        keep = [i for i, u in enumerate(warm["user"]) if u in users]
        assert part == {k: [v[i] for i in keep] for k, v in warm.items()}
    again = convert_melu(src, tmp_path / "p", protocol="melu", include_ids=True, valid_fraction=0.25)
    assert _read(tmp_path / "p", "warm_state_valid")["user"] == valid["user"] and again.users == report.users
    other = convert_melu(src, tmp_path / "q", protocol="melu", valid_fraction=0.5, seed=2)
    assert other.users["warm_state_valid"] == 2
    assert not (tmp_path / "o" / "user_cold_state_valid").exists()


def test_default_protocol_keeps_every_user_and_writes_no_split(fixture, tmp_path):
    src, states = fixture
    report = convert_melu(src, tmp_path / "o", include_ids=True)
    assert report.protocol == "all" and report.query_count == 0
    assert report.users["warm_state"] == len(SIZES) and report.users_filtered["warm_state"] == 0
    schema = open_dataset(tmp_path / "o" / "warm_state").schema
    assert schema.timestamp is None and RANK_COLUMN not in schema.column_names()
    # Overrides one by one: MeLU's protocol without the upper bound keeps 101 and 150.
    report = convert_melu(src, tmp_path / "p", protocol="melu", max_ratings=1000)
    assert report.users["warm_state"] == 6 and report.users_below["warm_state"] == 2
    assert report.users_above["warm_state"] == 0
    report = convert_melu(src, tmp_path / "q", min_ratings=13, max_ratings=100)
    assert report.users["warm_state"] == 4 and report.query_count == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"protocol": "maml"}, "protocol must be one of all, melu, got 'maml'"),
        ({"protocol": "melu", "min_ratings": 10}, "min_ratings must exceed query_count"),
        ({"query_count": -1}, "query_count must be >= 0"),
        ({"valid_fraction": 1.0}, r"valid_fraction must be in \[0, 1\), got 1.0"),
        ({"valid_fraction": 0.2, "states": ["user_cold_state"]}, "valid_fraction needs warm_state"),
        ({"min_ratings": 20, "max_ratings": 13}, "need 1 <= min_ratings <= max_ratings"),
        ({"seed": -1}, "seed must be >= 0"),
        (
            {"protocol": "melu", "valid_fraction": 0.1},
            "valid_fraction 0.1 of 4 warm_state users leaves an empty side",
        ),
    ],
)
def test_bad_rules_are_one_line_config_errors(fixture, tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        convert_melu(fixture[0], tmp_path / "o", **kwargs)


def test_cli_protocol_options(fixture, tmp_path, capsys):
    from recaccel.cli import data_main

    out = tmp_path / "o"
    argv = ["melu", str(fixture[0]), str(out), "--protocol", "melu", "--seed", "4", "--valid-fraction", "0.5"]
    assert data_main(argv) == 0
    report = json.loads((out / "melu.json").read_text())
    assert (report["protocol"], report["seed"], report["query_count"]) == ("melu", 4, 10)
    assert report["users"]["warm_state_valid"] == 2 and report["users"]["user_cold_state"] == 3
    assert (
        data_main(["melu", str(fixture[0]), str(tmp_path / "p"), "--max-ratings", "12", "--query-count", "0"])
        == 0
    )
    assert json.loads((tmp_path / "p" / "melu.json").read_text())["users"]["warm_state"] == 2
    capsys.readouterr()


def test_real_states_match_melus_own_counts(shared_data, tmp_path):
    """Per state, users and ratings equal MeLU's filter applied to the raw JSON (the three
    smaller states; warm_state: 2,653 users, 121,811 ratings, checked in bench/results)."""
    src = shared_data("melu-ml-1m", "user_cold_state.json")
    states = ("user_cold_state", "item_cold_state", "user_and_item_cold_state")
    report = convert_melu(src, tmp_path / "o", states=states, protocol="melu")
    expected = {"user_cold_state": (668, 30478), "item_cold_state": (2863, 106814)}
    expected["user_and_item_cold_state"] = (723, 26790)
    for state in states:
        lengths = [len(v) for v in json.loads((src / f"{state}.json").read_text()).values()]
        kept = [n for n in lengths if 13 <= n <= 100]
        assert (report.users[state], report.rows[state]) == (len(kept), sum(kept)) == expected[state]
        assert report.query_rows[state] == 10 * len(kept)
        assert report.users_filtered[state] == len(lengths) - len(kept)
