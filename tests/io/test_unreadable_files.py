"""Data paths that cannot be read: unreadable ``*.parquet`` entries of a data folder are
skipped with one warning or refused (``data.unreadable_files``); a FIFO or device given as
the data is refused in one line instead of blocking; a name that is not UTF-8 is
printed with its bytes escaped."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recaccel.config import Config, DataConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.dataset import list_files, open_dataset
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers.rows import BatchReader
from recaccel.preflight import preflight

REPO = Path(__file__).resolve().parents[2]
ROWS = 40
LOGGER = "recaccel.io.format.dataset"


def _dataset(folder: Path) -> Path:
    """A two-file dataset of ROWS rows."""
    import numpy as np

    schema = FeatureSchema(dense=("d0",), sparse=(SparseField("s0", 10),))
    rng = np.random.default_rng(0)
    cols = {
        "label": rng.integers(0, 2, ROWS).astype(np.float32),
        "d0": rng.normal(size=ROWS),
        "s0": rng.integers(0, 10, ROWS),
    }
    write_parquet(folder, schema, cols, rows_per_row_group=10, rows_per_file=ROWS // 2)
    return folder


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def _rows_read(folder: Path, **data) -> int:
    cfg = DataConfig(train=str(folder), shuffle=False, drop_last=False, batch_size=7, **data)
    return sum(b.batch_size for b in BatchReader.from_config(folder, cfg, train=True))


def _run_cli(main: str, *args: str) -> subprocess.CompletedProcess:
    """A recaccel console script in a child process (a hang fails the test, not the run)."""
    code = f"import sys; from recaccel.cli import {main}; sys.exit({main}(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, timeout=90, cwd=REPO, check=False
    )


def test_dangling_symlinks_and_symlink_loops_are_skipped_with_one_warning(tmp_path, caplog):
    folder = _dataset(tmp_path / "d")
    (folder / "a-gone.parquet").symlink_to(tmp_path / "nowhere.parquet")
    (folder / "b-loop.parquet").symlink_to(folder / "b-loop.parquet")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        files = list_files(folder)
        list_files(folder)  # every reader lists the folder again: still one warning
        assert _rows_read(folder) == ROWS
    assert [f.name for f in files] == ["part-00000.parquet", "part-00001.parquet"]
    [line] = _warnings(caplog)
    assert "\n" not in line
    assert "2 *.parquet entries cannot be read" in line
    assert f"first: {folder / 'a-gone.parquet'}, which is a dangling symlink" in line


def test_a_symlink_loop_alone_is_named_as_one(tmp_path):
    folder = _dataset(tmp_path / "d")
    (folder / "loop.parquet").symlink_to(folder / "loop.parquet")
    with pytest.raises(DataError, match=r"loop\.parquet, which is a symlink loop"):
        list_files(folder, unreadable="error")
    with pytest.raises(DataError, match=r"^file \S+loop\.parquet: is a symlink loop$"):
        list_files(folder / "loop.parquet")


def test_unreadable_files_error_refuses_the_folder_naming_the_first_entry(tmp_path, caplog):
    folder = _dataset(tmp_path / "d")
    (folder / "gone.parquet").symlink_to(tmp_path / "nowhere.parquet")
    msg = (
        rf"^file {folder}: 1 \*\.parquet entry cannot be read \(first: {folder / 'gone.parquet'}, "
        r"which is a dangling symlink\); fix or remove them, or set data\.unreadable_files"
    )
    with pytest.raises(DataError, match=msg):
        _rows_read(folder, unreadable_files="error")
    with pytest.raises(DataError, match=msg):
        open_dataset(folder, unreadable="error")
    cfg = Config()
    cfg.data = DataConfig(train=str(folder), test=str(folder), unreadable_files="error")
    cfg.train.out_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=rf"^config key data\.train={folder}: file {folder}: 1 \*\.parquet"):
        preflight(cfg)
    assert _warnings(caplog) == []


def test_unreadable_files_takes_only_warn_or_error():
    with pytest.raises(ConfigError, match=r"data\.unreadable_files"):
        DataConfig(unreadable_files="ignore")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without read permission")
def test_a_file_without_read_permission_is_skipped_with_a_warning(tmp_path, caplog):
    folder = _dataset(tmp_path / "d")
    locked = folder / "part-00001.parquet"
    locked.chmod(0)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert _rows_read(folder) == ROWS // 2
        [line] = _warnings(caplog)
        assert f"first: {locked}, which cannot be read (permission denied)" in line
        with pytest.raises(
            DataError, match=r"^file \S+part-00001\.parquet: cannot be read \(permission denied\)$"
        ):
            list_files(locked)
    finally:
        locked.chmod(0o644)


def test_a_fifo_inside_a_data_folder_is_skipped_without_being_opened(tmp_path, caplog):
    folder = _dataset(tmp_path / "d")
    os.mkfifo(folder / "pipe.parquet")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _rows_read(folder) == ROWS
    [line] = _warnings(caplog)
    assert "pipe.parquet, which is not a regular file (a FIFO)" in line


def test_a_folder_named_like_a_parquet_file_is_reported_not_silently_skipped(tmp_path, caplog):
    folder = _dataset(tmp_path / "d")
    (folder / "spark-output.parquet").mkdir()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert len(list_files(folder)) == 2
    [line] = _warnings(caplog)
    assert "spark-output.parquet, which is not a regular file (a folder)" in line


def test_a_folder_of_only_unreadable_entries_says_so(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "gone.parquet").symlink_to(tmp_path / "nowhere.parquet")
    with pytest.raises(DataError, match=r"directory has no readable \*\.parquet files"):
        list_files(folder)


def test_a_fifo_as_data_train_is_refused_in_one_line(tmp_path):
    fifo = tmp_path / "train.parquet"
    os.mkfifo(fifo)
    done = _run_cli(
        "train_main",
        *("--set", f"data.train={fifo}", "--set", f"data.test={fifo}"),
        *("--set", f"train.out_dir={tmp_path / 'run'}"),
    )
    assert done.returncode == 2
    assert done.stderr.decode().strip() == (
        f"recaccel-train: error: config key data.train={fifo}: file {fifo}: is not a regular file (a FIFO)"
    )


def test_a_fifo_given_to_inspect_is_refused_in_one_line(tmp_path):
    fifo = tmp_path / "x.parquet"
    os.mkfifo(fifo)
    done = _run_cli("data_main", "inspect", str(fifo))
    assert done.returncode == 2
    assert (
        done.stderr.decode().strip() == f"recaccel-data: error: file {fifo}: is not a regular file (a FIFO)"
    )


def test_a_character_device_is_refused_by_name():
    with pytest.raises(DataError, match=r"^file /dev/null: is not a regular file \(a character device\)$"):
        open_dataset("/dev/null")


def test_a_file_name_that_is_not_utf8_is_printed_with_its_bytes_escaped(tmp_path, caplog):
    folder = _dataset(tmp_path / "d")
    raw = os.fsencode(folder) + b"/\xff.parquet"
    try:
        os.link(os.fsencode(folder / "part-00000.parquet"), raw)
    except OSError as e:  # some file systems refuse such names
        pytest.skip(f"this file system refuses the name: {e}")
    shown = f"{folder}/\\xff.parquet"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _rows_read(folder) == ROWS
    [line] = _warnings(caplog)
    assert f"first: {shown}, which has a name that is not UTF-8 (rename it)" in line
    line.encode("utf-8")  # printable: no lone surrogates
    done = _run_cli("data_main", "inspect", os.fsdecode(raw))
    assert done.returncode == 2
    assert done.stderr.decode().strip() == (
        f"recaccel-data: error: file {shown}: has a name that is not UTF-8 (rename it)"
    )
