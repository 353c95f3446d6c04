"""MovieLens 100K to task-grouped Parquet with cold-start splits.

Input: the GroupLens ``ml-100k`` folder (``u.data``, ``u.user``, ``u.item`` in
Latin-1, ``u.genre``, ``u.occupation``). Output: ``<out>/train`` and ``<out>/test``
(``part-*.parquet``, rows sorted by user then timestamp, so each user is one task)
plus ``<out>/movielens.json`` (the report).

Columns (schema ``label_kind="rating"``, the rating 1..5 as label; with
``binarize=True`` ``label_kind="binary"`` and label = rating >= 4):

- ``user_id``, ``item_id``: the raw ids (id 0 is unused; cardinality = max id + 1);
- ``age``: bucket of the user's age: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
  (the MovieLens 1M buckets), ids 0..6;
- ``gender``: M = 0, F = 1;
- ``occupation``: line index in ``u.occupation``;
- ``zip``: 1 + the first digit of the zip code, 0 for a non-numeric (non-US) code;
- ``genres`` (multi-hot): the genre ids (``u.genre``) flagged for the movie;
- ``year``: release decade, 1 = the 1920s or earlier .. 8 = the 1990s or later,
  0 = unknown release date;
- ``user`` (task key, int64) and ``timestamp`` (unix seconds, int64).

Scenarios (``test_fraction`` = f, drawn with ``numpy.random.default_rng(seed)``):

- ``new_users``: a random fraction f of the users is held out with all their ratings;
- ``new_items``: a random fraction f of the items is held out: test holds every
  rating of a held-out item, train every other rating;
- ``new_users_items``: f of the users and f of the items are held out: train holds
  ratings of kept users on kept items, test ratings of held-out users on held-out
  items; mixed ratings are dropped (counted in ``dropped_rows``);
- ``time``: ratings with a timestamp after the (1 - f) quantile go to test.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recaccel.config import MovieLensScenario, choices
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.columns import take_csr
from recaccel.io.format.grouping import grouped_schema, task_order
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import DatasetWriter
from recaccel.output_paths import write_text_atomic

SCENARIOS = choices(MovieLensScenario)
AGE_EDGES = (18, 25, 35, 45, 50, 56)
NUM_DECADES = 8
FIRST_DECADE = 1920


@dataclass
class MovieLensReport:
    """What :func:`convert_movielens` wrote.

    Attributes:
        src, out_dir: the input folder and the dataset folder.
        scenario, test_fraction, seed, binarize: the arguments.
        schema: the dataset schema.
        train_rows, test_rows: rows per split.
        train_users, test_users: distinct users (tasks) per split.
        train_items, test_items: distinct items per split.
        dropped_rows: ratings in neither split (``new_users_items``).
        train_paths, test_paths: the files written.
    """

    src: str
    out_dir: str
    scenario: str
    test_fraction: float
    seed: int
    binarize: bool
    schema: FeatureSchema
    train_rows: int
    test_rows: int
    train_users: int
    test_users: int
    train_items: int
    test_items: int
    dropped_rows: int
    train_paths: list[str]
    test_paths: list[str]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Tables:
    ratings: np.ndarray  # int64 [n, 4]: user, item, rating, timestamp
    user_attrs: np.ndarray  # int64 [max user + 1, 4]: age bucket, gender, occupation, zip
    item_year: np.ndarray  # int64 [max item + 1]
    genre_values: np.ndarray  # int64 [N] genre ids of all items
    genre_offsets: np.ndarray  # int64 [max item + 2]: item i's genres are values[off[i]:off[i+1]]
    num_genres: int
    num_occupations: int


def movielens_schema(
    num_users: int, num_items: int, num_genres: int, num_occupations: int, binarize: bool
) -> FeatureSchema:
    """The schema of a converted split (cardinalities from the vocabularies)."""
    sparse = (
        SparseField("user_id", num_users),
        SparseField("item_id", num_items),
        SparseField("age", len(AGE_EDGES) + 1),
        SparseField("gender", 2),
        SparseField("occupation", num_occupations),
        SparseField("zip", 11),
        SparseField("genres", num_genres, multi_hot=True),
        SparseField("year", NUM_DECADES + 1),
    )
    base = FeatureSchema(dense=(), sparse=sparse, label_kind="binary" if binarize else "rating")
    return grouped_schema(base, "user", "timestamp")


def convert_movielens(
    src: str | Path,
    out_dir: str | Path,
    *,
    scenario: str = "new_users",
    test_fraction: float = 0.2,
    seed: int = 0,
    binarize: bool = False,
    rows_per_row_group: int = 8192,
    overwrite: bool = False,
    compression: str = "snappy",
) -> MovieLensReport:
    """Converts MovieLens 100K into task-grouped ``train`` and ``test`` splits (module doc).

    ``compression`` is the Parquet codec of the written files (see
    :data:`recaccel.config.ParquetCodec`).

    Raises:
        ConfigError: on a bad scenario or fraction.
        DataError: naming file, line and value for a missing file or a malformed line.
    """
    if scenario not in SCENARIOS:
        raise ConfigError(f"scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    src, out = Path(src), Path(out_dir)
    t = read_movielens(src)
    r = t.ratings
    in_test, in_train = _split(r, scenario, test_fraction, seed)
    schema = movielens_schema(
        t.user_attrs.shape[0], t.item_year.shape[0], t.num_genres, t.num_occupations, binarize
    )
    writers = {
        s: DatasetWriter(out / s, schema, rows_per_row_group, overwrite=overwrite, compression=compression)
        for s in ("train", "test")
    }
    counts = {}
    with writers["train"], writers["test"]:
        for split, mask in (("train", in_train), ("test", in_test)):
            rows = r[mask]
            rows = rows[task_order(rows[:, 0], rows[:, 3])]
            writers[split].write(_columns(rows, t, binarize))
            counts[split] = (rows.shape[0], np.unique(rows[:, 0]).size, np.unique(rows[:, 1]).size)
    report = MovieLensReport(
        src=str(src),
        out_dir=str(out),
        scenario=scenario,
        test_fraction=test_fraction,
        seed=seed,
        binarize=binarize,
        schema=schema,
        train_rows=counts["train"][0],
        test_rows=counts["test"][0],
        train_users=counts["train"][1],
        test_users=counts["test"][1],
        train_items=counts["train"][2],
        test_items=counts["test"][2],
        dropped_rows=int(r.shape[0] - in_train.sum() - in_test.sum()),
        train_paths=[str(p) for p in writers["train"].paths],
        test_paths=[str(p) for p in writers["test"].paths],
    )
    write_text_atomic(out / "movielens.json", json.dumps(report.to_dict(), indent=2))
    return report


def _split(r: np.ndarray, scenario: str, f: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(test mask, train mask) over the ratings."""
    rng = np.random.default_rng(seed)

    def held(ids: np.ndarray) -> np.ndarray:
        uniq = np.unique(ids)
        chosen = rng.choice(uniq, size=max(1, int(round(f * uniq.size))), replace=False)
        return np.isin(ids, chosen)

    if scenario == "time":
        test = r[:, 3] > np.quantile(r[:, 3], 1.0 - f)
        return test, ~test
    if scenario == "new_users":
        test = held(r[:, 0])
        return test, ~test
    if scenario == "new_items":
        test = held(r[:, 1])
        return test, ~test
    new_user, new_item = held(r[:, 0]), held(r[:, 1])
    return new_user & new_item, ~new_user & ~new_item


def _columns(rows: np.ndarray, t: _Tables, binarize: bool) -> dict:
    users, items, rating = rows[:, 0], rows[:, 1], rows[:, 2].astype(np.float32)
    genres = take_csr(t.genre_values, t.genre_offsets, items)
    attrs = t.user_attrs[users]
    return {
        "label": (rating >= 4).astype(np.float32) if binarize else rating,
        "user_id": users,
        "item_id": items,
        "age": attrs[:, 0],
        "gender": attrs[:, 1],
        "occupation": attrs[:, 2],
        "zip": attrs[:, 3],
        "genres": genres,
        "year": t.item_year[items],
        "user": users,
        "timestamp": rows[:, 3],
    }


def read_movielens(src: Path) -> _Tables:
    """Parses the five files of MovieLens 100K.

    Raises:
        DataError: naming file, line and value for anything malformed.
    """
    genres = _vocab_lines(src / "u.genre", "|")
    occupations = _vocab_lines(src / "u.occupation", None)
    occ_id = {name: i for i, name in enumerate(occupations)}
    users = _fields(src / "u.user", "|", 5, "utf-8")
    items = _fields(src / "u.item", "|", 5 + len(genres), "latin-1")
    max_user = max(_int(f[0], src / "u.user", ln) for ln, f in users)
    user_attrs = np.zeros((max_user + 1, 4), dtype=np.int64)
    for ln, f in users:
        path = src / "u.user"
        uid, age = _int(f[0], path, ln), _int(f[1], path, ln)
        if f[2] not in ("M", "F"):
            raise DataError(f"line {ln}: gender {f[2]!r} is not M or F", path=str(path))
        if f[3] not in occ_id:
            raise DataError(f"line {ln}: occupation {f[3]!r} is not in u.occupation", path=str(path))
        zip_id = int(f[4][0]) + 1 if f[4][:1].isdigit() else 0
        user_attrs[uid] = (np.searchsorted(AGE_EDGES, age, "right"), f[2] == "F", occ_id[f[3]], zip_id)
    max_item = max(_int(f[0], src / "u.item", ln) for ln, f in items)
    item_year = np.zeros(max_item + 1, dtype=np.int64)
    flags = np.zeros((max_item + 1, len(genres)), dtype=bool)
    for ln, f in items:
        path = src / "u.item"
        iid = _int(f[0], path, ln)
        date = f[2].strip()
        if date:
            year = _int(date[-4:], path, ln)
            item_year[iid] = min(max((year - FIRST_DECADE) // 10 + 1, 1), NUM_DECADES)
        bits = f[5:]
        if any(b not in ("0", "1") for b in bits):
            raise DataError(f"line {ln}: genre flags {bits} must be 0 or 1", path=str(path))
        flags[iid] = [b == "1" for b in bits]
    item_of, genre_of = np.nonzero(flags)  # row-major: grouped by item, genres ascending
    offsets = np.zeros(max_item + 2, dtype=np.int64)
    np.cumsum(np.bincount(item_of, minlength=max_item + 1), out=offsets[1:])
    ratings = _ratings(src / "u.data", max_user, max_item)
    return _Tables(
        ratings, user_attrs, item_year, genre_of.astype(np.int64), offsets, len(genres), len(occupations)
    )


def _ratings(path: Path, max_user: int, max_item: int) -> np.ndarray:
    lines = [ln for ln in _read(path, "utf-8").splitlines() if ln.strip()]
    if not lines:
        raise DataError("file has no ratings", path=str(path))
    parts = [ln.split("\t") for ln in lines]
    try:
        if any(len(p) != 4 for p in parts):
            raise ValueError
        arr = np.array(parts, dtype=np.int64)
    except ValueError:
        for i, p in enumerate(parts, 1):
            if len(p) != 4 or not all(x.strip().lstrip("-").isdigit() for x in p):
                raise DataError(
                    f"line {i}: expected 4 tab-separated integers, got {lines[i - 1]!r}", path=str(path)
                ) from None
        raise
    for col, name, lo, hi in ((0, "user", 1, max_user), (1, "item", 1, max_item), (2, "rating", 1, 5)):
        bad = np.flatnonzero((arr[:, col] < lo) | (arr[:, col] > hi))
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"line {i + 1}: {name} {int(arr[i, col])} is outside {lo}..{hi}", path=str(path), column=name
            )
    return arr


def _read(path: Path, encoding: str) -> str:
    if not path.is_file():
        raise DataError("file does not exist", path=str(path))
    return path.read_bytes().decode(encoding)


def _vocab_lines(path: Path, sep: str | None) -> list[str]:
    """Names of a vocabulary file in id order: ``name|id`` lines (ids 0, 1, ...) when
    ``sep``, else one name per line (id = line order)."""
    names = []
    for ln, line in enumerate(_read(path, "latin-1").splitlines(), 1):
        if not line.strip():
            continue
        if sep is None:
            names.append(line.strip())
            continue
        name, _, ident = line.partition(sep)
        if _int(ident, path, ln) != len(names):
            raise DataError(
                f"line {ln}: id {ident!r} is not {len(names)} (ids must be 0, 1, ... in order)",
                path=str(path),
            )
        names.append(name)
    if not names:
        raise DataError("vocabulary file is empty", path=str(path))
    return names


def _fields(path: Path, sep: str, count: int, encoding: str) -> list[tuple[int, list[str]]]:
    out = []
    for ln, line in enumerate(_read(path, encoding).splitlines(), 1):
        if not line.strip():
            continue
        f = line.split(sep)
        if len(f) != count:
            raise DataError(
                f"line {ln}: expected {count} {sep!r}-separated fields, got {len(f)}", path=str(path)
            )
        out.append((ln, f))
    if not out:
        raise DataError("file has no records", path=str(path))
    return out


def _int(text: str, path: Path, line: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(f"line {line}: {text!r} is not an integer", path=str(path)) from None
