"""Outputs never replace an input, nor (without --force / --overwrite) an existing file:
the helper itself, recaccel-data inspect --write-schema and the converters' folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recaccel.cli import data_main
from recaccel.output_paths import OutputError, Read, check_output, check_output_dir, write_atomic

TINY_SYNTH = [
    "synth.train_rows=200",
    "synth.test_rows=50",
    "synth.num_dense=2",
    "synth.num_sparse=2",
    "synth.cardinality=20",
    "synth.rows_per_row_group=100",
]


def _parquet(path: Path, rows: int = 40) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"clicked": [i % 2 for i in range(rows)], "item": list(range(rows))}), path)
    return path


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _criteo_tsv(path: Path, rows: int = 10) -> Path:
    cats = [f"{0x1000 * (j + 1):08x}" for j in range(26)]
    line = "\t".join(["1", *[str(j) for j in range(13)], *cats]) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line * rows)
    return path


# ------------------------------------------------------------------ the helper


def test_an_existing_output_is_refused_without_force_and_allowed_with_it(tmp_path):
    out = tmp_path / "m.json"
    out.write_text("old")
    with pytest.raises(OutputError, match=rf"^--out {out} exists \(pass --force to replace it\)$"):
        check_output(out, flag="--out", force=False)
    assert check_output(out, flag="--out", force=True) == out


def test_an_output_that_is_an_input_is_refused_even_with_force(tmp_path):
    data = _parquet(tmp_path / "data" / "part-0.parquet")
    link = tmp_path / "alias.parquet"
    os.link(data, link)  # the same file under another name
    reads = [Read(tmp_path / "data", "the data this command reads")]
    for out, how in ((data, "is inside"), (tmp_path / "data" / "new.parquet", "is inside")):
        with pytest.raises(OutputError, match=f"{how} the data this command reads; write it elsewhere"):
            check_output(out, flag="--predictions", force=True, reads=reads)
    with pytest.raises(OutputError, match="is the data file"):
        check_output(link, flag="--predictions", force=True, reads=[Read(data, "the data file")])


def test_a_folder_read_by_named_files_accepts_outputs_beside_them(tmp_path):
    source = Read(tmp_path, "the MovieLens folder", whole=False)
    assert check_output(tmp_path / "report.json", flag="--out", force=False, reads=[source])
    with pytest.raises(OutputError, match="is the MovieLens folder"):
        check_output_dir(tmp_path, (".",), flag="out_dir", force=True, reads=[source])


def test_an_interrupted_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "model.pt"
    out.write_bytes(b"old model")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"half of a new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(out, half_then_fail)
    assert out.read_bytes() == b"old model" and sorted(tmp_path.iterdir()) == [out]
    write_atomic(out, lambda tmp: tmp.write_bytes(b"new model"))
    assert out.read_bytes() == b"new model" and sorted(tmp_path.iterdir()) == [out]


# ------------------------------------------------------------------ recaccel-data inspect


def test_inspect_refuses_an_existing_schema_file_without_force(tmp_path, capsys):
    data = _parquet(tmp_path / "d.parquet")
    schema = tmp_path / "schema.toml"
    schema.write_text("# my reviewed schema\n")
    assert data_main(["inspect", str(data), "--write-schema", str(schema)]) == 2
    err = _error_line(capsys)
    assert err == f"recaccel-data: error: --write-schema {schema} exists (pass --force to replace it)"
    assert schema.read_text() == "# my reviewed schema\n"
    assert data_main(["inspect", str(data), "--write-schema", str(schema), "--force"]) == 0
    assert "[data.schema]" in schema.read_text()


def test_inspect_refuses_to_write_the_schema_over_the_data_it_reads_even_with_force(tmp_path, capsys):
    data = _parquet(tmp_path / "d.parquet")
    before = data.read_bytes()
    assert data_main(["inspect", str(data), "--write-schema", str(data), "--force"]) == 2
    err = _error_line(capsys)
    assert f"--write-schema {data} is the data this command reads; write it elsewhere" in err
    assert data.read_bytes() == before


# ------------------------------------------------------------------ converters


def test_criteo_refuses_a_split_folder_holding_files_without_overwrite(tmp_path, capsys):
    src = _criteo_tsv(tmp_path / "in.tsv")
    notes = tmp_path / "out" / "test" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")
    argv = ["criteo", str(src), str(tmp_path / "out"), "--cardinality", "10"]
    assert data_main(argv) == 2
    err = _error_line(capsys)
    assert f"out_dir {tmp_path / 'out'} already holds {notes.parent} (pass --overwrite to replace it)" in err
    assert not (tmp_path / "out" / "train").exists() and notes.read_text() == "mine"
    assert data_main([*argv, "--force"]) == 0  # --force is --overwrite
    capsys.readouterr()


def test_criteo_writes_beside_its_source_in_the_same_folder(tmp_path, capsys):
    src = _criteo_tsv(tmp_path / "criteo" / "day_0.tsv")
    before = src.read_bytes()
    assert data_main(["criteo", str(src), str(tmp_path / "criteo"), "--cardinality", "10"]) == 0
    report = json.loads((tmp_path / "criteo" / "criteo.json").read_text())
    assert report["train_rows"] + report["test_rows"] == 10 and src.read_bytes() == before
    capsys.readouterr()


@pytest.mark.parametrize("where", ["inside", "around"])
def test_tasks_refuses_an_out_dir_overlapping_its_source_even_with_overwrite(tmp_path, capsys, where):
    src = tmp_path / "data" / "train"
    part = _parquet(src / "part-00000.parquet")
    before = part.read_bytes()
    out = src / "grouped" if where == "inside" else tmp_path / "data"
    argv = ["tasks", str(src), str(out), "--task-key", "item", "--overwrite"]
    assert data_main(argv) == 2
    err = _error_line(capsys)
    assert err.startswith(f"recaccel-data: error: out_dir {out}") and "the data this command reads" in err
    assert part.read_bytes() == before and sorted(src.iterdir()) == [part]


def test_synth_refuses_a_folder_holding_other_files_without_overwrite(tmp_path, capsys):
    out = tmp_path / "synth"
    mine = out / "train" / "notes.txt"  # not a part file: the dataset writer alone would keep it
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    before = mine.read_bytes()
    argv = ["synth", *[a for s in [*TINY_SYNTH, f'synth.out_dir="{out}"'] for a in ("--set", s)]]
    assert data_main(argv) == 2
    err = _error_line(capsys)
    assert f"synth.out_dir {out} already holds {out / 'train'} (pass --overwrite to replace it)" in err
    assert mine.read_bytes() == before and not (out / "synth.json").exists()
