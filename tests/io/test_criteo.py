"""Criteo TSV converter against a per-line Python reference of the documented transform."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss

from recaccel.errors import ConfigError, DataError
from recaccel.io.convert import criteo
from recaccel.io.convert.criteo import convert_criteo
from recaccel.io.format.schema import FeatureSchema

MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _reference_line(line: str, cards: list[int]) -> tuple[float, list[float], list[int]]:
    """The module docstring's transform, one line at a time in plain Python."""
    parts = line.rstrip("\n").split("\t")
    label = float(int(parts[0]))
    dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in parts[1:14]]
    ids = []
    for f, h in enumerate(parts[14:40]):
        if not h:
            ids.append(0)
            continue
        salted = (int(h, 16) + (f + 1) * 0x9E3779B97F4A7C15) & MASK64
        ids.append(1 + _splitmix64(salted) % (cards[f] - 1))
    return label, dense, ids


def _line(label="0", ints=None, cats=None) -> str:
    ints = ints if ints is not None else [str(j) for j in range(13)]
    cats = cats if cats is not None else [f"{0x1000 * (j + 1):08x}" for j in range(26)]
    return "\t".join([label, *ints, *cats]) + "\n"


def _tiny_lines() -> list[str]:
    ints_missing = ["", "-1", "5", "", "100000", "0", "", "7", "-3", "1", "2", "", "999999999999"]
    cats_missing = ["", "68fd1e64", "", "FFFFFFFF", "0", "00000000"] + [f"{7919 * j:x}" for j in range(20)]
    return [
        _line("0"),
        _line("1", ints=ints_missing),
        _line("0", cats=cats_missing),
        _line("1", ints=[""] * 13, cats=[""] * 26),
        _line("0", ints=["-5"] * 13),
        _line("1", cats=["abcdef0123456789"] * 26),
        _line("0", ints=[str(10**j) for j in range(13)]),
        _line("1"),
        _line("0", cats=["7"] * 26),
        _line("0"),
    ]


def _write(tmp_path: Path, lines: list[str], name="in.tsv") -> Path:
    path = tmp_path / name
    path.write_text("".join(lines))
    return path


def _read_split(paths) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in paths])


def _check_against_reference(table: pa.Table, lines: list[str], cards: list[int]) -> None:
    ref = [_reference_line(line, cards) for line in lines]
    assert table.num_rows == len(ref)
    torch.testing.assert_close(
        torch.tensor(table.column("label").to_numpy()), torch.tensor([r[0] for r in ref], dtype=torch.float32)
    )
    dense = np.stack([table.column(f"I{j + 1}").to_numpy() for j in range(13)], axis=1)
    expected = torch.tensor([r[1] for r in ref], dtype=torch.float32)
    torch.testing.assert_close(torch.from_numpy(dense), expected)
    ids = np.stack([table.column(f"C{j + 1}").to_numpy() for j in range(26)], axis=1)
    np.testing.assert_array_equal(ids, np.array([r[2] for r in ref], dtype=np.int64))


@pytest.mark.parametrize("cardinality", [1000, [2 + 7 * j for j in range(26)]])
def test_tiny_file_matches_reference(tmp_path, cardinality):
    lines = _tiny_lines()
    src = _write(tmp_path, lines)
    report = convert_criteo(src, tmp_path / "out", cardinality=cardinality, test_fraction=0.3)
    cards = cardinality if isinstance(cardinality, list) else [cardinality] * 26
    assert (report.train_rows, report.test_rows, report.skipped_rows) == (7, 3, 0)
    _check_against_reference(_read_split(report.train_paths), lines[:7], cards)
    _check_against_reference(_read_split(report.test_paths), lines[7:], cards)
    assert report.schema.cardinalities == cards
    schema = FeatureSchema.from_arrow(pq.read_schema(report.train_paths[0]), report.train_paths[0])
    assert schema == report.schema
    labels = [_reference_line(line, cards)[0] for line in lines]
    train_ctr = float(np.mean(labels[:7]))
    assert report.train_ctr == pytest.approx(train_ctr)
    assert report.test_ctr == pytest.approx(np.mean(labels[7:]))
    expected = log_loss(labels[7:], [train_ctr] * 3, labels=[0, 1])
    assert report.constant_logloss == pytest.approx(expected, rel=1e-9)
    assert json.loads((tmp_path / "out" / "criteo.json").read_text())["train_rows"] == 7


def test_block_boundaries_and_missing_final_newline(tmp_path, monkeypatch):
    lines = _tiny_lines()
    text = "".join(lines).rstrip("\n")  # last line without its newline
    src = tmp_path / "in.tsv"
    src.write_text(text)
    monkeypatch.setattr(criteo, "_BLOCK_BYTES", 37)  # far shorter than a line
    report = convert_criteo(src, tmp_path / "out", cardinality=97, test_fraction=0.2, rows_per_row_group=3)
    assert (report.train_rows, report.test_rows) == (8, 2)
    _check_against_reference(_read_split(report.train_paths), lines[:8], [97] * 26)
    _check_against_reference(_read_split(report.test_paths), lines[8:], [97] * 26)
    groups = pq.ParquetFile(report.train_paths[0]).metadata
    assert [groups.row_group(i).num_rows for i in range(groups.num_row_groups)] == [3, 3, 2]


hex_value = st.integers(0, 2**64 - 1).flatmap(
    lambda v: st.sampled_from([f"{v:x}", f"{v:X}", f"{v:016x}"])
) | st.just("")
int_value = st.integers(-(10**12), 10**12).map(str) | st.just("")


@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from("01"),
            st.lists(int_value, min_size=13, max_size=13),
            st.lists(hex_value, min_size=26, max_size=26),
        ),
        min_size=1,
        max_size=12,
    ),
    cardinality=st.integers(2, 2**40),
)
def test_random_lines_match_reference(tmp_path_factory, rows, cardinality):
    tmp = tmp_path_factory.mktemp("h")
    lines = [_line(label, ints, cats) for label, ints, cats in rows]
    report = convert_criteo(_write(tmp, lines), tmp / "out", cardinality=cardinality, test_fraction=0.0)
    _check_against_reference(_read_split(report.train_paths), lines, [cardinality] * 26)
    assert report.test_rows == 0 and math.isnan(report.test_ctr)


def _bad_lines() -> dict[str, tuple[str, str | None, str]]:
    """name -> (bad line, column named in the error, words in the message)."""
    ints = [str(j) for j in range(13)]
    cats = [f"{j:08x}" for j in range(26)]
    return {
        "too_few_columns": ("\t".join(["0", *ints, *cats[:-1]]) + "\n", None, "39 tab-separated columns"),
        "empty_line": ("\n", None, "1 tab-separated columns"),
        "label_two": (_line("2"), "label", "0 or 1"),
        "label_missing": (_line(""), "label", "0 or 1"),
        "float_in_int": (_line(ints=ints[:4] + ["1.5"] + ints[5:]), "I5", "not an integer"),
        "word_in_int": (_line(ints=ints[:12] + ["abc"]), "I13", "not an integer"),
        "non_hex": (_line(cats=cats[:6] + ["xyz12345"] + cats[7:]), "C7", "hexadecimal"),
        "hex_too_long": (_line(cats=cats[:25] + ["1" * 17]), "C26", "hexadecimal"),
        "bad_utf8": (_line(cats=["\udcff"] + cats[1:]), "C1", "hexadecimal"),
    }


@pytest.mark.parametrize("name", list(_bad_lines()))
def test_bad_line_error_names_file_line_and_column(tmp_path, name):
    bad, column, words = _bad_lines()[name]
    lines = _tiny_lines()
    lines.insert(3, bad)
    src = tmp_path / "in.tsv"
    src.write_bytes("".join(lines).encode("utf-8", "surrogateescape"))
    with pytest.raises(DataError, match=words) as err:
        convert_criteo(src, tmp_path / "out", cardinality=100)
    message = str(err.value)
    assert str(src) in message and "line 4" in message
    assert err.value.column == column


def test_first_bad_line_is_reported(tmp_path):
    lines = _tiny_lines()
    lines[6] = "0\t1\n"  # wrong column count, later
    lines[4] = _line(ints=["x"] * 13)  # bad value, earlier
    with pytest.raises(DataError, match="line 5") as err:
        convert_criteo(_write(tmp_path, lines), tmp_path / "out", cardinality=100)
    assert err.value.column == "I1"  # the leftmost bad column


def test_skip_policy_counts_and_drops_bad_lines(tmp_path):
    bads = _bad_lines()
    lines = _tiny_lines()
    lines.insert(2, bads["non_hex"][0])
    lines.insert(5, bads["too_few_columns"][0])
    lines.append(bads["label_two"][0])  # 13 lines: train 1..10, test 11..13
    report = convert_criteo(
        _write(tmp_path, lines), tmp_path / "out", cardinality=100, test_fraction=0.25, bad_rows="skip"
    )
    assert report.skipped_rows == 3 and report.skipped_lines == [3, 6, 13]
    good = [line for i, line in enumerate(lines, 1) if i not in (3, 6, 13)]
    assert (report.train_rows, report.test_rows) == (8, 2)
    _check_against_reference(_read_split(report.train_paths), good[:8], [100] * 26)
    _check_against_reference(_read_split(report.test_paths), good[8:], [100] * 26)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(cardinality=1), "cardinality of C1"),
        (dict(cardinality=[10] * 25), "26"),
        (dict(cardinality=10, bad_rows="drop"), "bad_rows"),
        (dict(cardinality=10, test_fraction=1.0), "test_fraction"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        convert_criteo(_write(tmp_path, _tiny_lines()), tmp_path / "out", **kwargs)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        convert_criteo(tmp_path / "nope.tsv", tmp_path / "out", cardinality=10)
    with pytest.raises(DataError, match="empty"):
        convert_criteo(_write(tmp_path, []), tmp_path / "out", cardinality=10)


def test_existing_output_needs_overwrite(tmp_path):
    src = _write(tmp_path, _tiny_lines())
    convert_criteo(src, tmp_path / "out", cardinality=10)
    with pytest.raises(DataError, match="already exists"):
        convert_criteo(src, tmp_path / "out", cardinality=10)
    assert convert_criteo(src, tmp_path / "out", cardinality=10, overwrite=True).train_rows == 8


def test_real_criteo_sample(tmp_path, shared_data):
    src = shared_data("criteo-kaggle-head10k", "train_examples.txt") / "train_examples.txt"
    cardinality = 50_000
    report = convert_criteo(src, tmp_path / "out", cardinality=cardinality, progress=True)
    assert (report.train_rows, report.test_rows, report.skipped_rows) == (8000, 2000, 0)
    train, test = _read_split(report.train_paths), _read_split(report.test_paths)
    for table in (train, test):
        for name in report.schema.sparse_names:
            ids = table.column(name).to_numpy()
            assert ids.min() >= 0 and ids.max() < cardinality
        for name in report.schema.dense:
            assert np.isfinite(table.column(name).to_numpy()).all()
    lines = src.read_text().splitlines(keepends=True)
    _check_against_reference(train.slice(0, 300), lines[:300], [cardinality] * 26)
    _check_against_reference(test.slice(1700), lines[9700:], [cardinality] * 26)
    test_labels = test.column("label").to_numpy()
    assert report.train_ctr == pytest.approx(float(train.column("label").to_numpy().mean(dtype=np.float64)))
    expected = log_loss(test_labels, np.full(test_labels.shape, report.train_ctr))
    assert report.constant_logloss == pytest.approx(expected, rel=1e-9)
