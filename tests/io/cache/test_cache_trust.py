"""A cache is trusted only after its checks: hostile or stale files are one error line
naming the file, never wrong rows or an out-of-range id."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from recaccel.errors import ConfigError, DataError
from recaccel.io.format.cache.build import build_cache
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.decode import Policies
from recaccel.io.readers import BatchReader, ReadOptions
from tests.helpers.row_data import small_dataset
from tests.helpers.same_batches import assert_same_batches


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trust")
    small_dataset(root / "src", n=100, rg=25, per_file=None)
    build_cache(root / "src", root / "cache")
    return root / "src", root / "cache"


@pytest.fixture
def cache(built, tmp_path) -> Path:
    """A private copy of the cache (tests damage it); its source stays where it was."""
    copy = tmp_path / "cache"
    shutil.copytree(built[1], copy)
    return copy


def read_all(path: Path, **options) -> list:
    return list(BatchReader(path, 16, ReadOptions(seed=1, **options)))


def test_a_truncated_column_file_is_one_error_naming_it(cache):
    dense = cache / "dense.f32"
    dense.write_bytes(dense.read_bytes()[:-4])
    with pytest.raises(DataError, match=r"dense\.f32: cache column file holds \d+ bytes.*truncated"):
        open_dataset(cache)


def test_a_missing_column_file_is_one_error_naming_it(cache):
    (cache / "ids.1").unlink()
    with pytest.raises(DataError, match=r"ids\.1: cache column file is missing"):
        read_all(cache)


@pytest.mark.parametrize("damage", ["{not json", "[]", '{"format": "recaccel-cache"}'])
def test_a_corrupt_manifest_is_one_error_naming_it(cache, damage):
    (cache / "cache.json").write_text(damage)
    with pytest.raises(DataError, match=r"cache\.json: .*(manifest|version).*rebuild it") as e:
        open_dataset(cache)
    assert "\n" not in str(e.value)


def test_a_manifest_of_another_format_version_is_refused(cache):
    raw = json.loads((cache / "cache.json").read_text())
    (cache / "cache.json").write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(DataError, match=r"cache format version 99, this recaccel reads 3"):
        open_dataset(cache)


def test_a_flipped_id_byte_is_one_error_naming_file_row_group_and_column_not_an_embedding_index(cache):
    raw = bytearray((cache / "ids.0").read_bytes())
    raw[4 * 30 + 3] ^= 0x40  # row 30 (row group 1) gets a huge id
    (cache / "ids.0").write_bytes(bytes(raw))
    with pytest.raises(
        DataError, match=r"row group 1, column 's0': cache column file ids.0 does not match its CRC-32"
    ):
        read_all(cache)


@pytest.mark.parametrize("file, row, column", [("dense.f32", 55, "dense"), ("labels.f32", 3, "labels")])
def test_a_flipped_bit_in_dense_values_or_labels_is_one_error_not_a_different_value(cache, file, row, column):
    raw = bytearray((cache / file).read_bytes())
    width = 4 * (2 if file == "dense.f32" else 1)  # small_dataset: 2 dense features
    raw[width * row] ^= 0x01  # the lowest mantissa bit: a value a range check cannot tell
    (cache / file).write_bytes(bytes(raw))
    with pytest.raises(
        DataError, match=rf"column '{column}': cache column file {file} does not match its CRC-32"
    ) as e:
        read_all(cache)
    assert "\n" not in str(e.value) and "rebuild it" in str(e.value)


def test_a_damaged_checksum_file_is_refused_when_the_reader_opens(cache):
    raw = bytearray((cache / "checksums.u32").read_bytes())
    raw[0] ^= 0xFF
    (cache / "checksums.u32").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"checksums.u32.*cache checksum file does not match its CRC-32"):
        read_all(cache)


def test_a_source_changed_since_the_build_is_refused(built, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(built[0], src)
    build_cache(src, tmp_path / "cache")
    assert len(read_all(tmp_path / "cache")) > 0
    part = next(src.glob("*.parquet"))
    st = part.stat()
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match=r"source file .*part.* changed since the cache was built.*rebuild"):
        open_dataset(tmp_path / "cache")


def test_a_cache_stands_alone_once_its_source_is_gone(built, tmp_path):
    shutil.copytree(built[0], tmp_path / "src")
    build_cache(tmp_path / "src", tmp_path / "cache")
    want = read_all(tmp_path / "src")
    shutil.rmtree(tmp_path / "src")
    assert len(read_all(tmp_path / "cache")) == len(want)


def test_reading_with_other_policies_than_the_build_names_the_policy(cache):
    with pytest.raises(
        ConfigError, match=r"data.invalid_ids = 'skip' but the cache at .* was built with 'error'"
    ):
        read_all(cache, policies=Policies(invalid_ids="skip"))


def test_an_existing_folder_is_refused_unless_forced(built, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"already holds files \(pass --force"):
        build_cache(built[0], tmp_path / "dst")
    build_cache(built[0], tmp_path / "dst", force=True)
    assert not (tmp_path / "dst" / "keep.txt").exists() and len(read_all(tmp_path / "dst")) > 0
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]  # no temporary folder left


def test_an_interrupted_build_leaves_nothing_that_reads_as_a_cache(built, tmp_path, monkeypatch):
    import recaccel.io.format.cache.build as build

    def fail(_text: str) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "manifest_json", fail)  # the build dies just before its manifest
    with pytest.raises(KeyboardInterrupt):
        build_cache(built[0], tmp_path / "dst")
    assert list(tmp_path.iterdir()) == []


def test_random_byte_flips_in_column_files_give_one_error_line_or_the_same_batches(built, tmp_path):
    """A fault campaign: 40 seeded single-byte flips anywhere in the cache's column files;
    each read raises one DataError line or yields exactly the batches of the intact cache."""
    want = read_all(built[1])
    files = sorted(p.name for p in built[1].iterdir() if p.name != "cache.json")
    rng = np.random.default_rng(11)
    outcomes = {"error": 0, "same": 0}
    for trial in range(40):
        cache = tmp_path / f"c{trial}"
        shutil.copytree(built[1], cache)
        name = files[int(rng.integers(len(files)))]
        raw = bytearray((cache / name).read_bytes())
        raw[int(rng.integers(len(raw)))] ^= int(rng.integers(1, 256))
        (cache / name).write_bytes(bytes(raw))
        try:
            got = read_all(cache)
        except DataError as e:
            assert "\n" not in str(e) and "rebuild it" in str(e), (name, str(e))
            outcomes["error"] += 1
            continue
        assert_same_batches(want, got)
        outcomes["same"] += 1
    assert outcomes["error"] >= 30, outcomes  # nearly every byte is read and checked
