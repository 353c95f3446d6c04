"""Categorical columns done right: exact vocabularies (row 0 = out of vocabulary), inspect
over several paths, collision-aware hash sizes and dense transforms."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import tomllib

from recaccel.cli import data_main
from recaccel.config import DataConfig, DenseTransform, config_from_dict, load_config
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.inspect import expected_collisions, hash_size, inspect_dataset
from recaccel.io.format.transforms import apply_transform
from recaccel.io.format.vocabulary import VocabularyCounter, load_vocabularies, vocabulary_text
from recaccel.io.readers.rows import BatchReader


def _rows(path, mapping) -> list[tuple[list[float], dict[str, list[int]]]]:
    """Every row the reader yields, in file order: (dense, {field: ids})."""
    cfg = DataConfig(train=str(path), schema=mapping, shuffle=False, drop_last=False)
    rows = []
    for b in BatchReader.from_config(path, cfg, train=True):
        off, val, bsz = b.sparse.offsets.tolist(), b.sparse.values.tolist(), b.batch_size
        for i in range(bsz):
            bags = {k: val[off[f * bsz + i] : off[f * bsz + i + 1]] for f, k in enumerate(b.sparse.keys)}
            rows.append((b.dense[i].tolist(), bags))
    return rows


def _frames(n_train=300, n_test=100, test_slots=5, seed=0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train and test frames; the test file has a city, items and tags train never saw (and
    slot ids up to ``test_slots - 1``, train's up to 4)."""
    rng = np.random.default_rng(seed)

    def frame(n, cities, items, tags, slots):
        city = rng.choice(cities, n)
        return pd.DataFrame(
            {
                "clicked": (np.isin(city, ["rome", "kyiv"]) ^ (rng.random(n) < 0.1)).astype(int),
                "price": rng.pareto(1.1, n) * 10,  # non-negative, long-tailed
                "age": rng.normal(40, 12, n),
                "city": city,
                "item": rng.integers(0, items, n) * 1000,  # sparse large ids: a vocabulary
                "slot": rng.integers(0, slots, n),  # small dense ids: cardinality
                "tags": [[f"t{t}" for t in rng.integers(0, tags, k)] for k in rng.integers(0, 3, n)],
            }
        )

    train = frame(n_train, ["paris", "rome", "oslo", "lima"], 50, 8, 5)
    test = frame(n_test, ["paris", "rome", "oslo", "lima", "kyiv"], 80, 12, test_slots)
    return train, test


def _inspect(tmp_path, *names: str, extra=()) -> tuple:
    schema = tmp_path / "schema.toml"
    argv = ["inspect", *(str(tmp_path / n) for n in names), "--write-schema", str(schema), *extra]
    assert data_main(argv) == 0
    return schema, config_from_dict(tomllib.loads(schema.read_text())).data.schema


def test_every_seen_value_gets_its_own_row_and_unseen_values_row_0(tmp_path, capsys):
    train, test = _frames()
    train.to_parquet(tmp_path / "train.parquet", index=False)
    test.to_parquet(tmp_path / "test.parquet", index=False)
    _, mapping = _inspect(tmp_path, "train.parquet")  # train only: the test's new values are unseen
    assert mapping.sparse["city"].vocabulary and mapping.sparse["item"].vocabulary
    assert mapping.sparse["slot"].cardinality == train.slot.max() + 1
    vocab = load_vocabularies(mapping.vocabulary_file)
    info = open_dataset(tmp_path / "test.parquet", mapping)
    for name in ("city", "item", "tags"):
        values = list(vocab[name].values)
        assert len(set(values)) == len(values)
        seen = set(train[name].explode().dropna()) if name == "tags" else set(train[name])
        assert set(values) == seen  # every train value, nothing else
        assert (
            info.schema.sparse[[f.name for f in info.schema.sparse].index(name)].cardinality
            == len(values) + 1
        )
    row_of = {n: {v: i + 1 for i, v in enumerate(vocab[n].values)} for n in ("city", "item", "tags")}
    rows = _rows(tmp_path / "test.parquet", mapping)
    assert len(rows) == len(test)
    for (_, bags), (_, want) in zip(rows, test.iterrows()):
        assert bags["city"] == [row_of["city"].get(want.city, 0)]
        assert bags["item"] == [row_of["item"].get(want["item"], 0)]
        assert bags["tags"] == [row_of["tags"].get(t, 0) for t in want.tags]
    assert any(bags["city"] == [0] for _, bags in rows)  # kyiv: unseen, row 0
    counts = dict(zip(vocab["city"].values, vocab["city"].counts))
    assert counts == train.city.value_counts().to_dict()
    assert list(vocab["city"].counts) == sorted(counts.values(), reverse=True)


def test_min_count_sends_rare_values_to_row_0(tmp_path):
    df = pd.DataFrame({"y": [0, 1] * 5, "u": ["a"] * 5 + ["b"] * 3 + ["c", "d"], "x": np.arange(10.0)})
    df.to_parquet(tmp_path / "d.parquet", index=False)
    counter = VocabularyCounter(100)
    counter.add(pa.array(df.u))
    (tmp_path / "v.json").write_text(vocabulary_text({"u": counter.vocabulary()}))
    raw = {"label": "y", "dense": ["x"], "vocabulary_file": str(tmp_path / "v.json")}
    for min_count, want in [
        (1, [1] * 5 + [2] * 3 + [3, 4]),
        (3, [1] * 5 + [2] * 3 + [0, 0]),
        (4, [1] * 5 + [0] * 5),
    ]:
        mapping = config_from_dict(
            {"data": {"schema": {**raw, "sparse": {"u": {"vocabulary": True, "min_count": min_count}}}}}
        ).data.schema
        assert open_dataset(tmp_path / "d.parquet", mapping).schema.cardinalities == [max(want) + 1]
        assert [bags["u"][0] for _, bags in _rows(tmp_path / "d.parquet", mapping)] == want


def test_inspect_over_two_paths_sizes_the_vocabulary_from_both_and_warns_on_one_file(tmp_path, capsys):
    train, test = _frames(test_slots=9)
    train.to_parquet(tmp_path / "train.parquet", index=False)
    (tmp_path / "test").mkdir()
    test.to_parquet(tmp_path / "test" / "part-0.parquet", index=False)
    _, mapping = _inspect(tmp_path, "train.parquet", "test")
    out = capsys.readouterr().out
    vocab = load_vocabularies(mapping.vocabulary_file)
    assert set(vocab["city"].values) == set(train.city) | set(test.city)
    assert set(vocab["item"].values) == set(train["item"]) | set(test["item"])
    assert mapping.sparse["slot"].cardinality == max(train.slot.max(), test.slot.max()) + 1
    assert "# warning: column slot: ids reach" in out and "would fail on" in out
    stats = {s.name: s for s in inspect_dataset([tmp_path / "train.parquet", tmp_path / "test"])}
    assert stats["city"].rows == len(train) + len(test)


def test_cold_start_test_file_evaluates_after_training(tmp_path):
    from recaccel import api

    train, test = _frames(n_train=400, n_test=150, test_slots=9)
    train.to_parquet(tmp_path / "train.parquet", index=False)
    test.to_parquet(tmp_path / "test.parquet", index=False)
    schema, _ = _inspect(tmp_path, "train.parquet", "test.parquet")
    run = tmp_path / "run"
    sets = [
        f'data.train="{tmp_path / "train.parquet"}"',
        f'data.test="{tmp_path / "test.parquet"}"',
        "data.batch_size=50",
        f'train.out_dir="{run}"',
        "train.steps=16",
        "train.progress=false",
        "train.device=cpu",
        "model.embedding_dim=4",
        "model.bottom_mlp=[8,4]",
        "model.top_mlp=[8,1]",
        "optim.lr=0.05",
    ]
    cfg = load_config(schema, sets)
    api.train(cfg)
    metrics = api.evaluate(api.run_config(run))
    assert metrics["eval_rows"] == len(test) and 0.0 <= metrics["auc"] <= 1.0
    saved = api.run_config(run).data.schema
    assert saved == cfg.data.schema and saved.transforms["price"].transform == "log1p"


def test_transforms_are_applied_as_read(tmp_path):
    df = pd.DataFrame({"y": [0, 1, 0, 1], "p": [0.0, 3.0, -2.0, 100.0], "a": [1, 2, 3, 4], "s": [1, 2, 3, 0]})
    df.to_parquet(tmp_path / "d.parquet", index=False)
    mapping = config_from_dict(
        {
            "data": {
                "schema": {
                    "label": "y",
                    "dense": ["p", "a"],
                    "sparse": {"s": {"cardinality": 4}},
                    "transforms": {
                        "p": {"transform": "log1p"},
                        "a": {"transform": "standardize", "mean": 2.5, "std": 1.25},
                    },
                }
            }
        }
    ).data.schema
    dense = np.array([d for d, _ in _rows(tmp_path / "d.parquet", mapping)])
    want_p = np.sign(df.p) * np.log1p(np.abs(df.p))
    np.testing.assert_allclose(dense[:, 0], want_p, rtol=1e-6)
    np.testing.assert_allclose(dense[:, 1], (df.a - 2.5) / 1.25, rtol=1e-6)
    got = apply_transform(df.p.to_numpy(), DenseTransform(transform="log1p"))
    assert got.dtype == np.float32 and np.array_equal(got, dense[:, 0].astype(np.float32))


def test_inspect_suggests_transforms_with_the_columns_statistics(tmp_path):
    train, _ = _frames()
    train.to_parquet(tmp_path / "train.parquet", index=False)
    _, mapping = _inspect(tmp_path, "train.parquet")
    assert mapping.transforms["price"].transform == "log1p"  # non-negative, long tail
    age = mapping.transforms["age"]
    assert age.transform == "standardize"
    assert math.isclose(age.mean, train.age.mean(), rel_tol=1e-9)
    assert math.isclose(age.std, train.age.std(ddof=0), rel_tol=1e-9)


def test_expected_collisions_match_a_seeded_simulation():
    rng = np.random.default_rng(0)
    for n, m in [(8, 16), (1000, 1000), (5000, 50_000), (300, 7)]:
        sims = [n - len(np.unique(rng.integers(0, m, n))) for _ in range(400)]
        mean, sem = np.mean(sims), np.std(sims) / math.sqrt(len(sims))
        assert abs(expected_collisions(n, m) - mean) < 4 * sem + 0.05, (n, m)


def test_hash_size_keeps_expected_collisions_under_one_percent():
    for n in (1, 8, 100, 12_345, 1_000_000):
        m = hash_size(n)
        assert expected_collisions(n, m) <= 0.01 * n
        assert m == 16 or expected_collisions(n, m - 1) > 0.01 * n  # the smallest such size
    assert expected_collisions(8, 16) > 1  # the old 2 x distinct: 8 cities, ~1.6 colliding


def test_vocabulary_mistakes_are_one_line_errors(tmp_path):
    with pytest.raises(
        ConfigError, match=r"data\.schema\.sparse\.u has vocabulary = true but data\.schema\.vocabulary_file"
    ):
        config_from_dict({"data": {"schema": {"sparse": {"u": {"vocabulary": True}}}}})
    with pytest.raises(ConfigError, match="exactly one of"):
        config_from_dict(
            {"data": {"schema": {"sparse": {"u": {"vocabulary": True, "hash": 4}}, "vocabulary_file": "v"}}}
        )
    with pytest.raises(ConfigError, match=r"data\.schema\.transforms names \['q'\]"):
        config_from_dict({"data": {"schema": {"dense": ["p"], "transforms": {"q": {"transform": "log1p"}}}}})
    pd.DataFrame({"y": [0, 1], "u": ["a", "b"]}).to_parquet(tmp_path / "d.parquet", index=False)
    raw = {"label": "y", "sparse": {"u": {"vocabulary": True}}, "vocabulary_file": str(tmp_path / "v.json")}
    mapping = config_from_dict({"data": {"schema": raw}}).data.schema
    with pytest.raises(DataError, match=r"v\.json.*cannot read the vocabulary file") as err:
        open_dataset(tmp_path / "d.parquet", mapping)
    assert "\n" not in str(err.value)
    (tmp_path / "v.json").write_text(json.dumps({"format": "recaccel.vocabulary", "columns": {}}))
    with pytest.raises(DataError, match=r"no vocabulary of column 'u'.*rerun recaccel-data inspect"):
        open_dataset(tmp_path / "d.parquet", mapping)
    (tmp_path / "v.json").write_text(
        json.dumps(
            {
                "format": "recaccel.vocabulary",
                "columns": {"u": {"type": "string", "values": ["a", "a"], "counts": [2, 1]}},
            }
        )
    )
    with pytest.raises(DataError, match=r"vocabulary of column 'u' must be"):
        open_dataset(tmp_path / "d.parquet", mapping)


def test_auto_vocabulary_takes_the_files_map_where_it_has_one_else_the_hash(tmp_path):
    df = pd.DataFrame({"y": [0, 1, 1], "u": ["a", "b", "a"], "v": ["x", "y", "z"]})
    df.to_parquet(tmp_path / "d.parquet", index=False)
    counter = VocabularyCounter(100)
    counter.add(pa.array(df.u))
    (tmp_path / "v.json").write_text(vocabulary_text({"u": counter.vocabulary()}))
    auto = {"vocabulary": "auto", "hash": 64}
    for vocabulary_file, want in [(str(tmp_path / "v.json"), [3, 64]), (None, [64, 64])]:
        raw = {"label": "y", "sparse": {"u": auto, "v": auto}, "vocabulary_file": vocabulary_file}
        mapping = config_from_dict({"data": {"schema": raw}}).data.schema
        assert open_dataset(tmp_path / "d.parquet", mapping).schema.cardinalities == want
    with pytest.raises(ConfigError, match=r'vocabulary = "auto" goes with hash = N'):
        config_from_dict({"data": {"schema": {"sparse": {"u": {"vocabulary": "auto"}}}}})
    with pytest.raises(ConfigError, match=r"data\.schema\.sparse\.u\.vocabulary=maybe must be"):
        config_from_dict({"data": {"schema": {"sparse": {"u": {"vocabulary": "maybe", "hash": 4}}}}})


def test_a_vocabulary_file_changed_after_inspect_is_refused_not_remapped(tmp_path):
    train, _ = _frames()
    train.to_parquet(tmp_path / "train.parquet", index=False)
    _, mapping = _inspect(tmp_path, "train.parquet")
    assert mapping.vocabulary_sha256 is not None
    assert open_dataset(tmp_path / "train.parquet", mapping).schema.num_sparse == 4
    path = tmp_path / "schema.vocab.json"
    raw = json.loads(path.read_text())
    raw["columns"]["city"]["values"].reverse()  # same size, other rows: would train on garbage
    path.write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"schema\.vocab\.json.*changed since the schema was written") as err:
        open_dataset(tmp_path / "train.parquet", mapping)
    assert "\n" not in str(err.value)
