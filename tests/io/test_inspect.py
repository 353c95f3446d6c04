"""recaccel-data inspect: column statistics and a suggested [data.schema] that trains as is."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomllib

from recaccel.cli import data_main
from recaccel.config import config_from_dict
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.inspect import inspect_dataset, suggest_mapping


def _frame(n=300):
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        {
            "clicked": rng.integers(0, 2, n),
            "price": rng.random(n),
            "item": rng.integers(0, 40, n),
            "user": [f"u{int(i)}" for i in rng.integers(0, 25, n)],
            "tags": [list(rng.integers(0, 9, k)) for k in rng.integers(0, 3, n)],
            "city": pd.Categorical(rng.choice(["a", "b", None], n)),
        }
    )


def test_stats_match_pandas_and_the_suggestion_reads_the_file(tmp_path, capsys):
    df = _frame()
    df.to_parquet(tmp_path / "d.parquet", index=False)
    stats = {s.name: s for s in inspect_dataset(tmp_path / "d.parquet")}
    for col in ("clicked", "item", "user", "city"):
        assert stats[col].distinct == df[col].nunique() and stats[col].exact
        assert stats[col].nulls == int(df[col].isna().sum())
    assert stats["tags"].distinct == len({t for tags in df.tags for t in tags})
    assert (stats["item"].min, stats["item"].max) == (df.item.min(), df.item.max())
    out = tmp_path / "schema.toml"
    assert data_main(["inspect", str(tmp_path / "d.parquet"), "--write-schema", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "column" in printed and "large_string" in printed and "[data.schema]" in printed
    mapping = config_from_dict(tomllib.loads(out.read_text())).data.schema
    assert mapping.label == "clicked" and mapping.label_kind == "binary" and mapping.dense == ["price"]
    assert mapping.sparse["item"].cardinality == 40
    assert mapping.sparse["user"].vocabulary  # strings: an exact map
    assert list(mapping.sparse) == ["item", "user", "tags", "city"]
    info = open_dataset(tmp_path / "d.parquet", mapping)  # the suggestion reads the file
    assert [f.multi_hot for f in info.schema.sparse] == [False, False, True, False]


def test_distinct_counts_turn_approximate_past_the_cap_and_say_so(tmp_path, capsys):
    n = 20_000
    pq.write_table(
        pa.table({"y": np.zeros(n), "id": np.arange(n) * 7}), tmp_path / "a.parquet", row_group_size=4000
    )
    (s,) = [s for s in inspect_dataset(tmp_path / "a.parquet", exact_limit=1000) if s.name == "id"]
    assert not s.exact and abs(s.distinct - n) < 0.06 * n
    exact = [s for s in inspect_dataset(tmp_path / "a.parquet") if s.name == "id"][0]
    assert exact.exact and exact.distinct == n
    data_main(["inspect", str(tmp_path / "a.parquet"), "--exact-limit", "1000", "--label", "y"])
    out = capsys.readouterr().out
    assert "~" in out and "estimated" in out and 'label_kind = "binary"' in out


def test_label_guess_and_errors(tmp_path, capsys):
    pq.write_table(pa.table({"a": [1.0, 2.0], "b": ["x", "y"]}), tmp_path / "a.parquet")
    stats = inspect_dataset(tmp_path / "a.parquet")
    assert 'label = "CHANGE_ME"' in suggest_mapping(stats)
    assert data_main(["inspect", str(tmp_path / "a.parquet"), "--label", "nope"]) == 2
    assert "--label 'nope' is not a column" in capsys.readouterr().err
    assert data_main(["inspect", str(tmp_path / "missing.parquet")]) == 2
    with pytest.raises(Exception, match="no such file"):
        inspect_dataset(tmp_path / "missing.parquet")


def test_a_corrupted_page_is_one_line_naming_the_file_and_row_group(tmp_path, capsys):
    """Page checksums are verified, as the training reader verifies them: statistics (and a
    schema suggestion) were drawn from the corrupted page's garbage, with exit status 0."""
    path = tmp_path / "a.parquet"
    ids = np.random.default_rng(0).integers(0, 20, 400)
    pq.write_table(
        pa.table({"label": np.zeros(400), "c1": ids}), path, row_group_size=100, write_page_checksum=True
    )
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(1)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start + chunk.total_compressed_size - 1] ^= 0xFF  # the last byte of a page body
    path.write_bytes(bytes(raw))
    assert data_main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (
        err.startswith(f"recaccel-data: error: file {path}, row group 2: cannot read Parquet file")
        and "CRC" in err
    )
