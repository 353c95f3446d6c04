"""MovieLens 100K converter on the real files, against plain-Python parsing of them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recaccel.config import TasksConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.convert.movielens import SCENARIOS, convert_movielens
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.grouping import grouped_claim
from recaccel.io.readers.tasks.reader import TaskReader


@pytest.fixture(scope="module")
def src(shared_data) -> Path:
    return shared_data("movielens-100k", "u.data")


@pytest.fixture(scope="module")
def raw(src):
    """Plain parsing: ratings, user and item attributes."""
    ratings = [tuple(int(x) for x in line.split("\t")) for line in (src / "u.data").read_text().splitlines()]
    users = {}
    for line in (src / "u.user").read_text().splitlines():
        uid, age, gender, occ, zipcode = line.split("|")
        users[int(uid)] = (int(age), gender, occ, zipcode)
    occupations = [o for o in (src / "u.occupation").read_text().splitlines() if o]
    items = {}
    for line in (src / "u.item").read_bytes().decode("latin-1").splitlines():
        f = line.split("|")
        items[int(f[0])] = (f[2], [i for i, flag in enumerate(f[5:]) if flag == "1"])
    return ratings, users, occupations, items


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("movielens")
    return {
        s: (convert_movielens(src, out / s, scenario=s, test_fraction=0.2, seed=3), out / s)
        for s in SCENARIOS
    }


def rows(path: Path) -> list[dict]:
    return [r for f in sorted(path.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def age_bucket(age: int) -> int:
    return sum(age >= edge for edge in (18, 25, 35, 45, 50, 56))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_splits_match_the_raw_ratings(converted, raw, scenario):
    report, out = converted[scenario]
    ratings, *_ = raw
    train, test = rows(out / "train"), rows(out / "test")
    key = lambda r: (r["user"], r["item_id"], int(r["label"]), r["timestamp"])  # noqa: E731
    got = Counter(map(key, train)) + Counter(map(key, test))
    assert report.train_rows == len(train) and report.test_rows == len(test)
    assert len(train) + len(test) + report.dropped_rows == len(ratings) == 100_000
    assert got <= Counter(ratings)  # every written row is a raw rating, none duplicated
    train_users, test_users = {r["user"] for r in train}, {r["user"] for r in test}
    train_items, test_items = {r["item_id"] for r in train}, {r["item_id"] for r in test}
    assert (report.train_users, report.test_users) == (len(train_users), len(test_users))
    if scenario == "new_users":
        assert not train_users & test_users and got == Counter(ratings)
        assert len(test_users) == round(0.2 * 943)
    if scenario == "new_items":
        assert not train_items & test_items and got == Counter(ratings)
        assert len(test_items) == round(0.2 * 1682)
    if scenario == "new_users_items":
        assert not train_users & test_users and not train_items & test_items
        # A rating of a kept user on a kept item is in train; of a new user on a new item, in test.
        assert Counter(r for r in ratings if r[0] in train_users and r[1] in train_items) == Counter(
            map(key, train)
        )
        assert Counter(r for r in ratings if r[0] in test_users and r[1] in test_items) == Counter(
            map(key, test)
        )
        assert report.dropped_rows > 0
    if scenario == "time":
        assert max(r["timestamp"] for r in train) <= min(r["timestamp"] for r in test)
        assert got == Counter(ratings)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_users_are_contiguous_tasks_in_time_order(converted, scenario):
    _, out = converted[scenario]
    for split in ("train", "test"):
        data = rows(out / split)
        users = [r["user"] for r in data]
        assert users == sorted(users)  # each user one contiguous block
        for a, b in zip(data, data[1:]):
            if a["user"] == b["user"]:
                assert a["timestamp"] <= b["timestamp"]
        info = open_dataset(out / split)
        assert info.schema.task_key == "user" and info.schema.timestamp == "timestamp"
        assert grouped_claim(info.schema) is not None and info.schema.label_kind == "rating"


def test_features_match_the_raw_attributes(converted, raw):
    _, out = converted["new_users"]
    _, users, occupations, items = raw
    info = open_dataset(out / "train")
    card = {f.name: f.cardinality for f in info.schema.sparse}
    assert card["user_id"] == 944 and card["item_id"] == 1683 and card["genres"] == 19
    for r in rows(out / "train")[::97] + rows(out / "test")[::97]:
        age, gender, occ, zipcode = users[r["user"]]
        date, genres = items[r["item_id"]]
        assert r["user_id"] == r["user"]
        assert r["age"] == age_bucket(age)
        assert r["gender"] == (1 if gender == "F" else 0)
        assert r["occupation"] == occupations.index(occ)
        assert r["zip"] == (int(zipcode[0]) + 1 if zipcode[0].isdigit() else 0)
        assert r["genres"] == genres
        decade = 0 if not date else min(max((int(date[-4:]) - 1920) // 10 + 1, 1), 8)
        assert r["year"] == decade
        assert 1 <= r["label"] <= 5


def test_binarized_labels_and_task_reading(src, raw, tmp_path):
    report = convert_movielens(src, tmp_path, scenario="time", binarize=True, test_fraction=0.1)
    data = rows(tmp_path / "test")
    ratings = {(u, i, t): r for u, i, r, t in raw[0]}
    assert all(r["label"] == float(ratings[(r["user"], r["item_id"], r["timestamp"])] >= 4) for r in data)
    assert report.schema.label_kind == "binary"
    c = TasksConfig(tasks_per_batch=16, support_size=8, query_size=8, min_task_rows=1, split="time")
    reader = TaskReader(tmp_path / "test", c, train=False)
    ids = [int(i) for tb in reader for i in tb.task_ids]
    assert ids == sorted({r["user"] for r in data}) and reader.counters["rows_yielded"] == len(data)


def test_bad_arguments_and_input(src, tmp_path):
    with pytest.raises(ConfigError, match="scenario"):
        convert_movielens(src, tmp_path, scenario="new_everything")
    with pytest.raises(ConfigError, match="test_fraction"):
        convert_movielens(src, tmp_path, test_fraction=1.0)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("u.user", "u.item", "u.genre", "u.occupation"):
        (bad / name).write_bytes((src / name).read_bytes())
    (bad / "u.data").write_text("1\t2\t3\t100\n5\t6\t9\t100\n")
    with pytest.raises(DataError, match=r"u.data.*line 2: rating 9 is outside 1..5"):
        convert_movielens(bad, tmp_path / "o")
    (bad / "u.data").write_text("1\t2\t3\t100\n5\tx\t1\n")
    with pytest.raises(DataError, match="line 2: expected 4 tab-separated integers"):
        convert_movielens(bad, tmp_path / "o")
    (bad / "u.user").write_text("1|24|X|technician|85711\n")
    with pytest.raises(DataError, match="u.user.*gender 'X'"):
        convert_movielens(bad, tmp_path / "o")
