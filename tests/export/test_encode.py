"""Serving from raw rows: model.json records each input's mapping, and encode() turns raw
rows into the exported program's inputs exactly as training saw them."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recaccel.cli import data_main, eval_main, export_main, train_main
from recaccel.config import DataConfig, load_config
from recaccel.errors import DataError, RecaccelError
from recaccel.export import encode
from recaccel.io.readers.rows import BatchReader


def _frame(n: int, seed: int, cities: list[str]) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    city = rng.choice(cities, n)
    return pd.DataFrame(
        {
            "clicked": (np.isin(city, ["rome", "kyiv"]) ^ (rng.random(n) < 0.1)).astype(int),
            "price": rng.pareto(1.1, n) * 10,
            "age": rng.normal(40, 12, n),
            "city": city,
            "user": [f"user-{i}" for i in rng.integers(0, 500, n)],  # many: hashed
            "item": rng.integers(0, 60, n) * 7919,
            "tags": [[f"t{t}" for t in rng.integers(0, 9, k)] for k in rng.integers(0, 3, n)],
        }
    )


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """Own Parquet (string categoricals, a cold-start test file) through inspect, train, export."""
    root = tmp_path_factory.mktemp("own")
    _frame(400, 0, ["paris", "rome", "oslo", "lima"]).to_parquet(root / "train.parquet", index=False)
    _frame(120, 1, ["paris", "rome", "oslo", "lima", "kyiv"]).to_parquet(root / "test.parquet", index=False)
    schema = root / "schema.toml"
    argv = ["inspect", str(root / "train.parquet"), str(root / "test.parquet"), "--write-schema", str(schema)]
    assert data_main([*argv, "--vocabulary-limit", "100"]) == 0  # user: 500 values -> a hash
    run = root / "run"
    sets = [
        f'data.train="{root / "train.parquet"}"',
        f'data.test="{root / "test.parquet"}"',
        "data.batch_size=50",
        f'train.out_dir="{run}"',
        "train.steps=12",
        "train.checkpoint_every=12",
        "train.progress=false",
        "train.device=cpu",
        "model.embedding_dim=4",
        "model.bottom_mlp=[8,4]",
        "model.top_mlp=[8,1]",
    ]
    assert train_main(["--config", str(schema), *(a for s in sets for a in ("--set", s))]) == 0
    assert export_main([str(run), "--format", "torch_export", str(root / "export" / "model.pt2")]) == 0
    return root


def test_model_json_records_each_fields_mapping(own_run):
    spec = json.loads((own_run / "export" / "model.json").read_text())
    fields = {f["name"]: f for f in spec["fields"]}
    assert fields["city"]["mapping"]["kind"] == "vocabulary" and fields["city"]["mapping"]["oov_row"] == 0
    assert set(fields["city"]["mapping"]["values"]) == {"paris", "rome", "oslo", "lima", "kyiv"}
    assert fields["city"]["cardinality"] == 6
    assert fields["user"]["mapping"]["kind"] == "hash"
    assert fields["user"]["mapping"]["buckets"] == fields["user"]["cardinality"]
    assert fields["tags"]["multi_hot"] and fields["tags"]["mapping"]["kind"] == "vocabulary"
    dense = {d["name"]: d for d in spec["dense"]}
    assert dense["price"]["transform"] == "log1p" and dense["age"]["transform"] == "standardize"
    assert abs(dense["age"]["mean"] - 40) < 3


def test_encode_gives_the_inputs_training_read(own_run):
    cfg = load_config(own_run / "run" / "config.toml", paths_relative_to_file=False)
    data = DataConfig(
        train=cfg.data.test, schema=cfg.data.schema, shuffle=False, drop_last=False, batch_size=1000
    )
    (batch,) = list(BatchReader.from_config(cfg.data.test, data, train=False))
    df = pd.read_parquet(own_run / "test.parquet")
    for rows in (df, pa.Table.from_pandas(df), df.drop(columns="clicked").to_dict(orient="list")):
        dense, values, offsets = encode(rows, own_run / "export")
        assert torch.equal(dense, batch.dense)
        assert torch.equal(values, batch.sparse.values.to(torch.int64))
        assert torch.equal(offsets, batch.sparse.offsets.to(torch.int64))
        assert values.dtype == offsets.dtype == torch.int64


def test_raw_rows_through_encode_and_the_program_give_eval_predictions(own_run):
    predictions = own_run / "pred.parquet"
    assert eval_main([str(own_run / "run"), "--predictions", str(predictions), "--force"]) == 0
    want = pq.read_table(predictions).column("prediction").to_numpy()
    program = torch.export.load(str(own_run / "export" / "model.pt2")).module()
    df = pd.read_parquet(own_run / "test.parquet").drop(columns="clicked")  # serving has no labels
    with torch.no_grad():
        got = program(*encode(df, own_run / "export" / "model.json")).double().numpy()
    assert len(got) == len(want) == 120
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    unseen = df.assign(city="atlantis", item=-5, tags=[["never"]] * len(df))  # all row 0: still scores
    with torch.no_grad():
        assert torch.isfinite(program(*encode(unseen.head(3), own_run / "export"))).all()


def test_encode_refuses_bad_rows_in_one_line(own_run):
    df = pd.read_parquet(own_run / "test.parquet").head(4)
    cases = [
        (df.drop(columns="city"), r"column 'city'.*(missing|no such column)"),
        (df.assign(city=[None, "rome", "oslo", "lima"]), r"column 'city'.*row 0"),
        (df.assign(tags=["a", "b", "c", "d"]), r"column 'tags'"),
        ([1, 2], r"rows must be a pandas DataFrame, a pyarrow Table or a dict of lists"),
    ]
    for rows, message in cases:
        with pytest.raises(DataError, match=message) as err:
            encode(rows, own_run / "export")
        assert "\n" not in str(err.value)
    with pytest.raises(RecaccelError, match=r"cannot read export description"):
        encode(df, own_run / "nothing.json")


def test_a_dict_of_lists_with_only_empty_bags_encodes_as_training_would(own_run):
    df = pd.read_parquet(own_run / "test.parquet").head(2).drop(columns="clicked")
    rows = {k: list(v) for k, v in df.to_dict(orient="list").items()}
    rows["tags"] = [[], []]  # Arrow types this list<null>
    dense, values, offsets = encode(rows, own_run / "export")
    typed = pa.Table.from_pandas(df.drop(columns="tags")).append_column(
        "tags", pa.array([[], []], pa.list_(pa.string()))
    )
    want = encode(typed, own_run / "export")
    assert torch.equal(dense, want[0])
    assert torch.equal(values, want[1]) and torch.equal(offsets, want[2])
    tags = [f["name"] for f in json.loads((own_run / "export" / "model.json").read_text())["fields"]].index(
        "tags"
    )
    assert offsets[tags * 2 + 2] == offsets[tags * 2]  # both bags empty
