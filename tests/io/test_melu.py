"""MeLU ML-1M converter on the real files, against plain-Python parsing of them.

The four states are converted once per module (about 1M rows, a few seconds).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recaccel.config import TasksConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.convert.melu import STATES, convert_melu
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.grouping import grouped_claim
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.tasks.reader import TaskReader


@pytest.fixture(scope="module")
def src(shared_data) -> Path:
    return shared_data("melu-ml-1m", "warm_state.json")


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("melu")
    return convert_melu(src, out, include_ids=True), out


def vocab(src: Path, attr: str) -> list[str]:
    return [
        line.strip()
        for line in (src / f"m_{attr}.txt").read_text(encoding="utf-8").split("\n")
        if line.strip()
    ]


def read_state(out: Path, state: str, columns: list[str]) -> dict[str, list]:
    return pq.read_table(sorted((out / state).glob("*.parquet")), columns=columns).to_pydict()


@pytest.mark.parametrize("state", STATES)
def test_rows_users_and_order_match_the_json(src, converted, state):
    report, out = converted
    x = json.loads((src / f"{state}.json").read_text())
    y = json.loads((src / f"{state}_y.json").read_text())
    data = read_state(out, state, ["user", "user_id", "item_id", "label"])
    assert report.rows[state] == len(data["user"]) == sum(len(v) for v in x.values())
    assert report.users[state] == len(x)
    # Each user is one contiguous block, blocks in ascending user id.
    starts = [i for i in range(len(data["user"])) if i == 0 or data["user"][i] != data["user"][i - 1]]
    assert [data["user"][i] for i in starts] == sorted(int(u) for u in x)
    got = defaultdict(list)
    for u, i, r in zip(data["user"], data["item_id"], data["label"]):
        got[u].append((i, r))
    for uid, movies in x.items():
        assert got[int(uid)] == [(int(m), float(r)) for m, r in zip(movies, y[uid])]  # file order kept
    assert data["user_id"] == data["user"]
    schema = open_dataset(out / state).schema
    card = {f.name: f.cardinality for f in schema.sparse}
    assert max(data["user"]) < card["user_id"] == 6041 and max(data["item_id"]) < card["item_id"] == 3953
    assert grouped_claim(schema) == {"task_key": "user", "timestamp": None}


def test_attributes_match_the_raw_files(src, converted):
    report, out = converted
    schema = open_dataset(out / "warm_state").schema
    for a in ("rate", "genre", "director", "actor", "gender", "age", "occupation", "zipcode"):
        field = next(f for f in schema.sparse if f.name == a)
        assert field.cardinality == len(vocab(src, a)) + 1
        assert field.multi_hot == (a in ("genre", "director", "actor"))
    ids = {a: {v: i + 1 for i, v in enumerate(vocab(src, a))} for a in ("rate", "genre", "director", "actor")}
    movies = {}
    for line in (src / "movies_extrainfos.dat").read_text(encoding="utf-8").splitlines():
        f = line.split("::")
        names = lambda text: ["nan" if v == "N/A" else v for v in text.split(", ")]  # noqa: E731
        directors = [re.sub(r"\([^()]*\)", "", d) for d in names(f[6])]
        movies[int(f[0])] = (
            ids["rate"][f[3]],
            list(dict.fromkeys(ids["genre"][g] for g in names(f[5]))),
            list(dict.fromkeys(ids["director"][d] for d in directors)),
            list(dict.fromkeys(ids["actor"][a] for a in names(f[8]))),
        )
    users = {}
    uv = {
        a: {v: i + 1 for i, v in enumerate(vocab(src, a))} for a in ("gender", "age", "occupation", "zipcode")
    }
    for line in (src / "users.dat").read_text().splitlines():
        f = line.split("::")
        users[int(f[0])] = (
            uv["gender"][f[1]],
            uv["age"][f[2]],
            uv["occupation"][f[3]],
            uv["zipcode"][f[4][:5]],
        )
    cols = ["user", "item_id", "rate", "genre", "director", "actor", "gender", "age", "occupation", "zipcode"]
    data = read_state(out, "user_and_item_cold_state", cols)
    for j in range(0, len(data["user"]), 37):
        m, u = movies[data["item_id"][j]], users[data["user"][j]]
        assert (data["rate"][j], data["genre"][j], data["director"][j], data["actor"][j]) == m
        assert (data["gender"][j], data["age"][j], data["occupation"][j], data["zipcode"][j]) == u
    assert report.unknown_values == dict.fromkeys(report.unknown_values, 0)


def test_melu_protocol_tasks(converted):
    _, out = converted
    c = TasksConfig(tasks_per_batch=32, support_size=90, query_size=10, min_task_rows=13, query_fraction=0.0)
    reader = TaskReader(out / "user_and_item_cold_state", c, ReadOptions(seed=0), train=False)
    data = read_state(out, "user_and_item_cold_state", ["user"])
    sizes = defaultdict(int)
    for u in data["user"]:
        sizes[u] += 1
    seen = {}
    for tb in reader:
        for key, ns, nq in zip(
            tb.task_ids.tolist(), tb.support_mask.sum(1).tolist(), tb.query_mask.sum(1).tolist()
        ):
            seen[key] = (int(ns), int(nq))
    assert seen == {u: (n - 10, 10) for u, n in sizes.items() if n >= 13}
    assert reader.counters["tasks_skipped_small"] == sum(1 for n in sizes.values() if n < 13)


def test_filters_unknown_values_and_errors(src, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    for f in src.glob("m_*.txt"):
        (fake / f.name).write_bytes(f.read_bytes())
    users = (src / "users.dat").read_text().splitlines()[:3]
    (fake / "users.dat").write_text("\n".join(users + ["4::F::99::1::12345"]) + "\n")  # age 99: unknown
    movies = (src / "movies_extrainfos.dat").read_text(encoding="utf-8").splitlines()[:2]
    (fake / "movies_extrainfos.dat").write_text("\n".join(movies) + "\n", encoding="utf-8")
    states = {"warm_state": ({"1": ["1", "2"], "4": ["2"]}, {"1": [5, 3], "4": [1]})}
    for s in STATES[1:]:
        states[s] = ({"2": ["1"] * 14}, {"2": [4] * 14})
    for s, (x, y) in states.items():
        (fake / f"{s}.json").write_text(json.dumps(x))
        (fake / f"{s}_y.json").write_text(json.dumps(y))
    report = convert_melu(fake, tmp_path / "o", min_ratings=2, binarize=True)
    assert report.unknown_values["age"] == 1
    assert report.rows["warm_state"] == 2 and report.users_filtered["warm_state"] == 1
    warm = read_state(tmp_path / "o", "warm_state", ["label", "user"])
    assert warm == {"label": [1.0, 0.0], "user": [1, 1]}
    with pytest.raises(DataError, match=r"users.dat.*line 4: age value '99' is not in m_age.txt"):
        convert_melu(fake, tmp_path / "o2", unknown="error")
    with pytest.raises(ConfigError, match="states"):
        convert_melu(fake, tmp_path / "o3", states=["cold"])
    (fake / "item_cold_state.json").write_text(json.dumps({"2": ["1"] * 13 + ["77"]}))
    with pytest.raises(DataError, match=r"item_cold_state.json.*movie '77' has no attribute record"):
        convert_melu(fake, tmp_path / "o4", states=["item_cold_state"])
    (fake / "item_cold_state.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        convert_melu(fake, tmp_path / "o5", states=["item_cold_state"])
