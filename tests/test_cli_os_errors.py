"""OS failures, exhausted memory and control characters in --set are one stderr line and
exit status 2 at the CLI, never a traceback (recaccel-data inspect --write-schema is the
cheapest real command that writes a file)."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recaccel.cli import data_main, train_main


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"clicked": [0, 1] * 20, "item": list(range(40))}), path)
    return path


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_disk_full_names_the_path_and_the_bytes_free_and_keeps_the_old_file(
    data, tmp_path, capsys, monkeypatch
):
    schema = tmp_path / "schema.toml"
    schema.write_text("# reviewed\n")
    real_write_text = Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if self.parent == tmp_path:  # the write the command does, half done, then the disk is full
            real_write_text(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert data_main(["inspect", str(data), "--write-schema", str(schema), "--force"]) == 2
    err = _error_line(capsys)
    pattern = rf"recaccel-data: error: {re.escape(str(schema))}: disk full \(no space left on device\); \d+ bytes free on its filesystem"
    assert re.fullmatch(pattern, err), err
    assert schema.read_text() == "# reviewed\n" and sorted(tmp_path.iterdir()) == [data, schema]


def test_a_file_name_too_long_is_one_line_naming_it(data, tmp_path, capsys):
    schema = tmp_path / ("s" * 300 + ".toml")  # over NAME_MAX (255) on Linux filesystems
    assert data_main(["inspect", str(data), "--write-schema", str(schema)]) == 2
    assert _error_line(capsys) == f"recaccel-data: error: {schema}: file name too long"


def test_a_read_only_folder_is_one_line_naming_the_path(data, tmp_path, capsys):
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o500)
        schema = folder / "schema.toml"
    else:  # root ignores permission bits; sysfs refuses new files even to root
        if not Path("/sys/kernel").is_dir():
            pytest.skip("running as root without sysfs: no folder refuses root's writes")
        schema = Path("/sys/recaccel-schema.toml")
    assert data_main(["inspect", str(data), "--write-schema", str(schema)]) == 2
    err = _error_line(capsys)
    assert re.fullmatch(
        rf"recaccel-data: error: {re.escape(str(schema))}: (permission denied|read-only filesystem)", err
    )
    assert not schema.exists()


def test_an_output_below_a_file_is_refused_naming_the_file(data, tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    schema = blocker / "schema.toml"
    assert data_main(["inspect", str(data), "--write-schema", str(schema)]) == 2
    assert (
        _error_line(capsys)
        == f"recaccel-data: error: --write-schema {schema}: {blocker} is a file, not a folder"
    )


def test_another_os_error_is_one_line_with_its_reason_and_path(data, capsys, monkeypatch):
    def failing_disk(paths, **kwargs):  # inspect reads every path given: it fails on the first
        first = paths[0] if isinstance(paths, list) else paths
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(first))

    monkeypatch.setattr("recaccel.io.format.inspect.inspect_dataset", failing_disk)
    assert data_main(["inspect", str(data)]) == 2
    assert _error_line(capsys) == f"recaccel-data: error: {data}: {os.strerror(errno.EIO)}"


def test_out_of_memory_is_one_line_naming_the_allocation_and_what_to_reduce(data, capsys, monkeypatch):
    def too_big(path, **kwargs):
        raise MemoryError(
            "Unable to allocate 8.00 GiB for an array with shape (1073741824,) and data type float64"
        )

    monkeypatch.setattr("recaccel.io.format.inspect.inspect_dataset", too_big)
    assert data_main(["inspect", str(data)]) == 2
    err = _error_line(capsys)
    assert err.startswith("recaccel-data: error: out of memory (Unable to allocate 8.00 GiB for an array")
    assert "reduce data.batch_size" in err


def test_torchs_cpu_allocator_failing_is_one_line_naming_the_allocation(data, capsys, monkeypatch):
    """torch reports a failed host allocation as a RuntimeError, not a MemoryError: the
    message it raises for a tensor no host can hold, caught by the command."""
    import torch

    def too_big(path, **kwargs):
        torch.empty(2**62, dtype=torch.uint8)

    monkeypatch.setattr("recaccel.io.format.inspect.inspect_dataset", too_big)
    assert data_main(["inspect", str(data)]) == 2
    err = _error_line(capsys)
    assert err.startswith(f"recaccel-data: error: out of memory (tried to allocate {2**62} bytes)")
    assert "model.top_mlp" in err


def test_another_runtime_error_still_reaches_the_user_as_a_bug(data, monkeypatch):
    def broken(path, **kwargs):
        raise RuntimeError("an internal error, not an allocation")

    monkeypatch.setattr("recaccel.io.format.inspect.inspect_dataset", broken)
    with pytest.raises(RuntimeError, match="an internal error"):
        data_main(["inspect", str(data)])


@pytest.mark.parametrize("control", ["\n", "\r", "\t", "\x00"])
def test_set_value_with_a_control_character_is_refused_naming_the_key(tmp_path, capsys, monkeypatch, control):
    monkeypatch.chdir(tmp_path)  # nothing may be written: the refusal comes first
    value = f'train.out_dir="{tmp_path / "run"}"{control}train.steps=1'
    assert train_main(["--set", value, "--set", "train.progress=false"]) == 2
    err = _error_line(capsys)
    assert err.startswith(
        "recaccel-train: error: override 'train.out_dir': the value holds a control character"
    )
    assert list(tmp_path.iterdir()) == []


def test_synth_set_value_with_a_newline_is_refused_naming_the_key(tmp_path, capsys):
    out = tmp_path / "synth"
    assert data_main(["synth", "--set", f'synth.out_dir="{out}"\nsynth.train_rows=10']) == 2
    assert "override 'synth.out_dir': the value holds a control character ('\\n')" in _error_line(capsys)
    assert not out.exists()
