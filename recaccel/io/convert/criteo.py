"""Criteo TSV (Kaggle display advertising / Terabyte) to a recaccel Parquet dataset.

Input lines are ``label<TAB>I1..I13<TAB>C1..C26``: a 0/1 label, 13 integer counts and
26 categorical values written as hex strings (8 digits in the public files); an empty
field is a missing value. The transform, as in the usual DLRM preprocessing:

- ``I_j`` -> ``log(1 + max(x, 0))`` as float32; missing -> 0. Negative counts occur
  (``I2``) and are clipped at 0 before the log.
- ``C_j`` (field index ``f = j - 1``) -> single-hot int64 id in ``0 .. cardinality-1``:
  missing -> the reserved id 0; a hex string ``h`` ->
  ``1 + mix64((int(h, 16) + (f + 1) * 0x9E3779B97F4A7C15) mod 2**64) mod (cardinality - 1)``
  where ``mix64`` is the SplitMix64 finalizer (:func:`recaccel.hashing.mix64`). The hash depends only on
  the value and the field, so ids are the same in every process and run.
- The last ``round(lines * test_fraction)`` lines go to the test split, the others to
  train (the files are in time order, so this is a time split).

The file is read twice (a line count, then blocks of lines), so memory is bounded by
the block size whatever the file size. Bad lines (wrong number of columns, label not
0/1, a non-integer in an integer column, a non-hex categorical) raise
:class:`DataError` naming the file, line and column, or with ``bad_rows="skip"`` are
dropped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from tqdm.auto import tqdm

from recaccel.config import BadRowsPolicy, choices
from recaccel.errors import ConfigError, DataError
from recaccel.hashing import GAMMA, mix64
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import DatasetWriter
from recaccel.output_paths import write_text_atomic

logger = logging.getLogger(__name__)

NUM_INT = 13
NUM_CAT = 26
INT_COLUMNS = tuple(f"I{j + 1}" for j in range(NUM_INT))
CAT_COLUMNS = tuple(f"C{j + 1}" for j in range(NUM_CAT))
TSV_COLUMNS = ("label", *INT_COLUMNS, *CAT_COLUMNS)

_BLOCK_BYTES = 1 << 23
_PATTERNS = {  # what a valid field looks like, and what to say when it does not
    "label": ("^[01]$", "label must be 0 or 1"),
    "int": ("^(-?[0-9]{1,18})?$", "not an integer (or more than 18 digits)"),
    "cat": ("^([0-9a-fA-F]{1,16})?$", "not a hexadecimal string of at most 16 digits"),
}


def _hex_table() -> np.ndarray:
    """uint64 [256]: the value of each ASCII hex digit (0 for other bytes)."""
    table = np.zeros(256, dtype=np.uint64)
    for digits in ("0123456789abcdef", "0123456789ABCDEF"):
        table[np.frombuffer(digits.encode(), dtype=np.uint8)] = np.arange(16, dtype=np.uint64)
    return table


_HEX_NIBBLE = _hex_table()


@dataclass
class CriteoReport:
    """What :func:`convert_criteo` wrote.

    Attributes:
        src: The TSV file.
        out_dir: The dataset directory.
        schema: The dataset schema.
        train_paths: Parquet files of the train split.
        test_paths: Parquet files of the test split.
        train_rows: Rows written to train.
        test_rows: Rows written to test.
        skipped_rows: Bad lines dropped (``bad_rows="skip"``).
        skipped_lines: The first (up to 20) skipped line numbers, 1-based.
        train_ctr: Mean label of the train split.
        test_ctr: Mean label of the test split (NaN if it is empty).
        constant_logloss: Test logloss of always predicting ``train_ctr``.
    """

    src: str
    out_dir: str
    schema: FeatureSchema
    train_paths: list[str]
    test_paths: list[str]
    train_rows: int
    test_rows: int
    skipped_rows: int
    skipped_lines: list[int]
    train_ctr: float
    test_ctr: float
    constant_logloss: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def criteo_schema(cardinality: int | Sequence[int]) -> FeatureSchema:
    """Schema of a converted file: dense ``I1..I13``, single-hot ``C1..C26``, ``label``.

    Raises:
        ConfigError: if a cardinality is < 2 or the list does not have 26 entries.
    """
    cards = [cardinality] * NUM_CAT if isinstance(cardinality, int) else list(cardinality)
    if len(cards) != NUM_CAT:
        raise ConfigError(f"cardinality list has {len(cards)} entries, expected one per field ({NUM_CAT})")
    for name, card in zip(CAT_COLUMNS, cards):
        if isinstance(card, bool) or not isinstance(card, (int, np.integer)) or card < 2:
            raise ConfigError(
                f"cardinality of {name} must be an integer >= 2 (id 0 is for missing), got {card!r}"
            )
    sparse = tuple(SparseField(name, int(card)) for name, card in zip(CAT_COLUMNS, cards))
    return FeatureSchema(dense=INT_COLUMNS, sparse=sparse)


def hash_ids(values: np.ndarray, field: int, cardinality: int) -> np.ndarray:
    """Maps parsed categorical values uint64 [n] of field ``field`` to ids in 1..cardinality-1."""
    salt = np.uint64(((field + 1) * GAMMA) % 2**64)
    salted = np.asarray(values, dtype=np.uint64) + salt  # wraps mod 2**64
    return (mix64(salted) % np.uint64(cardinality - 1)).astype(np.int64) + 1


def convert_criteo(
    src: str | Path,
    out_dir: str | Path,
    *,
    cardinality: int | Sequence[int],
    test_fraction: float = 0.2,
    rows_per_row_group: int = 8192,
    rows_per_file: int | None = 1_000_000,
    bad_rows: BadRowsPolicy = "error",
    overwrite: bool = False,
    progress: bool = False,
    compression: str = "snappy",
) -> CriteoReport:
    """Converts a Criteo TSV to ``<out_dir>/{train,test}/part-*.parquet`` (module doc).

    Args:
        src: The TSV file.
        out_dir: Output directory; also receives ``criteo.json`` (the report).
        cardinality: Buckets per categorical field (id 0 included), or one per field.
        test_fraction: Fraction of the lines, taken from the end, that form the test split.
        rows_per_row_group: Rows per Parquet row group.
        rows_per_file: Rows per Parquet file (None: one file per split).
        bad_rows: ``"error"`` raises on the first bad line; ``"skip"`` drops and counts.
        overwrite: Replace existing part files in the split directories.
        progress: Show a progress bar over the bytes read.
        compression: Parquet codec of the written files (``snappy``, ``lz4``, ``zstd``,
            ``gzip``, ``none``; see :mod:`recaccel.io.format.writer`).

    Returns:
        The report.

    Raises:
        ConfigError: on a bad argument.
        DataError: on a bad line (policy ``error``), a missing or empty file, or a
            train split without rows.
    """
    if bad_rows not in choices(BadRowsPolicy):
        raise ConfigError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
    if not 0.0 <= test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in [0, 1), got {test_fraction}")
    schema = criteo_schema(cardinality)
    src_path, out = Path(src), Path(out_dir)
    if not src_path.is_file():
        raise DataError("file does not exist", path=str(src_path))
    total_lines = _count_lines(src_path)
    if total_lines == 0:
        raise DataError("file is empty", path=str(src_path))
    train_lines = total_lines - int(round(total_lines * test_fraction))
    splits = ("train", "test")
    writers = {
        s: DatasetWriter(
            out / s, schema, rows_per_row_group, rows_per_file, overwrite=overwrite, compression=compression
        )
        for s in splits
    }
    rows = dict.fromkeys(splits, 0)
    clicks = dict.fromkeys(splits, 0.0)
    skipped: list[int] = []
    num_skipped = 0
    with (
        writers["train"],
        writers["test"],
        tqdm(
            total=src_path.stat().st_size, unit="B", unit_scale=True, disable=not progress, desc="criteo"
        ) as bar,
    ):
        for first_line, block in _iter_blocks(src_path):
            parsed, bad_lines = _parse_block(block, first_line, schema, str(src_path), bad_rows)
            num_skipped += len(bad_lines)
            skipped.extend(bad_lines[: max(0, 20 - len(skipped))])
            in_train = parsed.pop("_line") <= train_lines
            for split, mask in (("train", in_train), ("test", ~in_train)):
                if mask.any():
                    cols = {name: values[mask] for name, values in parsed.items()}
                    writers[split].write(cols)
                    rows[split] += int(mask.sum())
                    clicks[split] += float(cols["label"].sum())
            bar.update(len(block))
    if num_skipped:
        logger.warning("%s: skipped %d bad lines (first: %s)", src_path, num_skipped, skipped[:5])
    if rows["train"] == 0:
        raise DataError("no valid rows in the train split", path=str(src_path))
    train_ctr = clicks["train"] / rows["train"]
    test_ctr = clicks["test"] / rows["test"] if rows["test"] else float("nan")
    report = CriteoReport(
        src=str(src_path),
        out_dir=str(out),
        schema=schema,
        train_paths=[str(p) for p in writers["train"].paths],
        test_paths=[str(p) for p in writers["test"].paths],
        train_rows=rows["train"],
        test_rows=rows["test"],
        skipped_rows=num_skipped,
        skipped_lines=skipped,
        train_ctr=train_ctr,
        test_ctr=test_ctr,
        constant_logloss=_constant_logloss(train_ctr, test_ctr),
    )
    write_text_atomic(out / "criteo.json", json.dumps(report.to_dict(), indent=2))
    return report


def _constant_logloss(pred: float, ctr: float, eps: float = 1e-7) -> float:
    """Logloss of predicting ``pred`` for every row of a split with mean label ``ctr``.

    Same clamping as :func:`recaccel.metrics.binary_logloss`.
    """
    p = min(max(pred, eps), 1 - eps)
    return float(-(ctr * np.log(p) + (1 - ctr) * np.log(1 - p)))


def _count_lines(path: Path) -> int:
    count, last = 0, b"\n"
    with open(path, "rb") as fh:
        while data := fh.read(_BLOCK_BYTES):
            count += data.count(b"\n")
            last = data[-1:]
    return count + (last != b"\n")  # a last line without its newline


def _iter_blocks(path: Path) -> Iterator[tuple[int, bytes]]:
    """Yields (number of the first line, 1-based; whole lines each ending in a newline)."""
    line_no, rest = 1, b""
    with open(path, "rb") as fh:
        while data := fh.read(_BLOCK_BYTES):
            buf = rest + data
            cut = buf.rfind(b"\n") + 1
            block, rest = buf[:cut], buf[cut:]
            if block:
                yield line_no, block
                line_no += block.count(b"\n")
    if rest:
        yield line_no, rest + b"\n"


@dataclass(frozen=True)
class _Lines:
    """Where the lines of a block are: byte starts/ends (the newline) [n], 1-based numbers
    [n] and tab-separated column counts [n]."""

    starts: np.ndarray
    ends: np.ndarray
    numbers: np.ndarray
    ncols: np.ndarray

    @classmethod
    def index(cls, arr: np.ndarray, first_line: int) -> _Lines:
        ends = np.flatnonzero(arr == ord("\n"))
        starts = np.concatenate([[0], ends[:-1] + 1])
        tabs = np.add.reduceat((arr == ord("\t")).view(np.uint8), starts, dtype=np.int64)
        return cls(starts, ends, first_line + np.arange(ends.size), tabs + 1)


def _parse_block(
    block: bytes, first_line: int, schema: FeatureSchema, path: str, bad_rows: str
) -> tuple[dict[str, np.ndarray], list[int]]:
    """Parses, checks and transforms a block of whole lines.

    Returns:
        (columns for :class:`DatasetWriter` plus ``"_line"``, int64 [n] line numbers;
        the numbers of the bad lines dropped under policy ``skip``).

    Raises:
        DataError: at the first bad line under policy ``error``.
    """
    arr = np.frombuffer(block, dtype=np.uint8)
    lines = _Lines.index(arr, first_line)
    shape_ok = lines.ncols == len(TSV_COLUMNS)
    table = None
    if shape_ok.all():
        table = _read_tsv(block)
    elif shape_ok.any():
        table = _read_tsv(arr[np.repeat(shape_ok, lines.ends - lines.starts + 1)].tobytes())
    good_lines = lines.numbers[shape_ok]  # the rows of `table`
    first_bad_col = _first_bad_column(table, good_lines.size)
    value_ok = first_bad_col < 0
    if bad_rows == "error" and not (shape_ok.all() and value_ok.all()):
        raise _first_error(block, lines, good_lines, first_bad_col, table, path)
    bad = np.sort(np.concatenate([lines.numbers[~shape_ok], good_lines[~value_ok]])).tolist()
    if table is None:
        return _empty_columns(schema), bad
    if not value_ok.all():
        table = table.filter(pa.array(value_ok))
    cols = _transform(table, schema)
    cols["_line"] = good_lines[value_ok]
    return cols, bad


def _read_tsv(data: bytes) -> pa.Table:
    """All 40 columns as raw bytes (a bad byte sequence is a bad value, not a reader
    crash); an empty field stays empty."""
    return pacsv.read_csv(
        pa.BufferReader(data),
        read_options=pacsv.ReadOptions(column_names=list(TSV_COLUMNS)),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(TSV_COLUMNS, pa.binary())),
    )


def _kind(name: str) -> str:
    return "label" if name == "label" else ("int" if name in INT_COLUMNS else "cat")


def _first_bad_column(table: pa.Table | None, n: int) -> np.ndarray:
    """Index of the leftmost invalid column of each row, int64 [n]; -1 where the row is valid."""
    first_bad = np.full(n, -1, dtype=np.int64)
    if table is None:
        return first_bad
    for c in reversed(range(len(TSV_COLUMNS))):  # reversed: the leftmost bad column wins
        pattern = _PATTERNS[_kind(TSV_COLUMNS[c])][0]
        ok = pc.match_substring_regex(table.column(c), pattern).to_numpy(zero_copy_only=False)
        first_bad[~ok] = c
    return first_bad


def _first_error(
    block: bytes,
    lines: _Lines,
    good_lines: np.ndarray,
    first_bad_col: np.ndarray,
    table: pa.Table | None,
    path: str,
) -> DataError:
    """The error of the earliest bad line of a block (wrong column count or bad value)."""
    shape_bad = np.flatnonzero(lines.ncols != len(TSV_COLUMNS))
    value_bad = np.flatnonzero(first_bad_col >= 0)
    never = np.iinfo(np.int64).max
    first_shape = lines.numbers[shape_bad[0]] if shape_bad.size else never
    first_value = good_lines[value_bad[0]] if value_bad.size else never
    if first_shape < first_value:
        i = shape_bad[0]
        text = block[lines.starts[i] : lines.ends[i]][:80].decode("utf-8", "replace")
        expected = len(TSV_COLUMNS)
        return DataError(
            f"line {first_shape} has {lines.ncols[i]} tab-separated columns, expected {expected}: {text!r}",
            path=path,
        )
    row = value_bad[0]
    col = int(first_bad_col[row])
    name = TSV_COLUMNS[col]
    value = table.column(col)[row].as_py()[:40].decode("utf-8", "replace")
    what = _PATTERNS[_kind(name)][1]
    return DataError(f"line {first_value}: value {value!r}: {what}", path=path, column=name)


def _transform(table: pa.Table, schema: FeatureSchema) -> dict[str, np.ndarray]:
    """Validated byte-string columns -> label float32, dense float32, ids int64 (module doc)."""
    cols = {"label": pc.equal(table.column("label"), b"1").to_numpy(zero_copy_only=False).astype(np.float32)}
    for name in INT_COLUMNS:
        raw = table.column(name)
        digits = pc.if_else(pc.equal(raw, b""), b"0", raw).cast(pa.string())  # validated ASCII
        ints = pc.cast(digits, pa.int64()).to_numpy()
        cols[name] = np.log1p(np.maximum(ints, 0)).astype(np.float32)
    for f, field in enumerate(schema.sparse):
        values, present = _parse_hex(table.column(field.name).combine_chunks())
        ids = np.zeros(values.size, dtype=np.int64)
        ids[present] = hash_ids(values[present], f, field.cardinality)
        cols[field.name] = ids
    return cols


def _parse_hex(strings: pa.BinaryArray) -> tuple[np.ndarray, np.ndarray]:
    """Validated hex byte strings [n] -> (values uint64 [n], non-empty bool [n]).

    Each digit is shifted to its place value and a cell's digits are summed (the bit
    fields are disjoint, so the sum is exact); no Python loop over rows.
    """
    n = len(strings)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int32)[strings.offset : strings.offset + n + 1]
    data_buf = strings.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    present = lengths > 0
    values = np.zeros(n, dtype=np.uint64)
    if not present.any():
        return values, present
    lo, hi = int(offsets[0]), int(offsets[-1])
    cell_end = np.repeat(offsets[1:], lengths)  # [digits] end offset of each digit's cell
    place = (cell_end - 1 - np.arange(lo, hi)).astype(np.uint64)
    digits = _HEX_NIBBLE[data[lo:hi]] << (np.uint64(4) * place)
    values[present] = np.add.reduceat(digits, offsets[:-1][present] - lo)
    return values, present


def _empty_columns(schema: FeatureSchema) -> dict[str, np.ndarray]:
    cols = {"label": np.zeros(0, np.float32), "_line": np.zeros(0, np.int64)}
    cols.update({name: np.zeros(0, np.float32) for name in schema.dense})
    cols.update({name: np.zeros(0, np.int64) for name in schema.sparse_names})
    return cols
