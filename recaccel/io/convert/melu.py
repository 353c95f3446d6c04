"""MeLU's preprocessed MovieLens 1M (Lee et al., KDD 2019) to task-grouped Parquet.

Input folder: ``<state>.json`` (user id -> movie ids) and ``<state>_y.json`` (user id
-> ratings, same order) for the four states ``warm_state``, ``user_cold_state``,
``item_cold_state`` and ``user_and_item_cold_state``; ``users.dat``
(``user::gender::age::occupation::zip``); ``movies_extrainfos.dat``
(``id::title::year::rate::released::genre::director::writer::actors::plot::poster``);
the vocabularies ``m_{rate,genre,director,actor,gender,age,occupation,zipcode}.txt``.

Output: ``<out>/<state>/part-*.parquet`` per state, one user = one task (rows sorted
by user id, a user's ratings in the order of the state file), and ``<out>/melu.json``.
Every state shares one schema, so a model trained on ``warm_state`` reads the others.

Protocols. ``protocol="all"`` (the default) keeps every user and leaves the
support/query split to the task reader (``[tasks]``). ``protocol="melu"`` reproduces
MeLU's own data generation (``data_generation.py`` of hoyeoplee/MeLU): a user with
fewer than 13 or more than 100 ratings is dropped, and 10 of a user's ratings, drawn at
random, are its query set, the other 3..90 its support set, fixed once. MeLU shuffles
with Python's unseeded ``random``; here user ``u``'s order is
``numpy.random.default_rng([seed, u]).permutation(n)``, so it depends only on the seed
and the user. The order is the int64 column ``melu_rank`` (0..n-1), recorded as the
schema's timestamp: rows are stored in that order (support rows first, then the query
rows, as MeLU lays them out), and ``tasks.split = "time"`` with ``tasks.query_count =
10`` reads exactly MeLU's split (the latest 10 "times" are the query). ``min_ratings``,
``max_ratings`` and ``query_count`` override the protocol's values one by one.

Validation users. ``valid_fraction > 0`` also writes ``warm_state_train`` and
``warm_state_valid``: ``round(valid_fraction * users)`` of warm_state's kept users,
chosen with ``default_rng([seed, 1])``, go to the validation set, the rest to the
training set (rows as in ``warm_state``), for choosing hyperparameters without the
four evaluation states.

Columns: label = the rating (``label_kind="rating"``; ``binarize=True``: rating >= 4,
``"binary"``); single-hot ``rate``, ``gender``, ``age``, ``occupation``, ``zipcode``;
multi-hot ``genre``, ``director``, ``actor`` (a movie's comma-separated list, each
name once); with ``include_ids`` also ``user_id`` and ``item_id`` (raw ids,
cardinality max id + 1); the task key ``user`` (int64 user id). There is no timestamp.

Vocabulary ids. Value ``v`` of an attribute gets id ``1 + (line of v in m_<attr>.txt)``;
id 0 is reserved for a value missing from the vocabulary (``unknown="reserved"``, the
default, counted per attribute in the report) or such a value is an error
(``unknown="error"``: a DataError naming file, line, attribute and value). Values are
normalised as MeLU's vocabularies were built: ``N/A`` is the vocabulary's ``nan``
entry, a director's parenthesised remark (``(co-director)``) is dropped, and a zip code
is its first five characters.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recaccel.errors import ConfigError, DataError
from recaccel.io.format.columns import take_csr
from recaccel.io.format.grouping import grouped_schema, task_order
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import DatasetWriter
from recaccel.output_paths import write_text_atomic

STATES = ("warm_state", "user_cold_state", "item_cold_state", "user_and_item_cold_state")
VALID_STATES = ("warm_state_train", "warm_state_valid")
# protocol -> (min_ratings, max_ratings, query_count); "melu": data_generation.py's rules.
PROTOCOLS: dict[str, tuple[int, int | None, int]] = {"all": (1, None, 0), "melu": (13, 100, 10)}
RANK_COLUMN = "melu_rank"
MOVIE_ATTRS = ("rate", "genre", "director", "actor")
USER_ATTRS = ("gender", "age", "occupation", "zipcode")
MULTI_HOT = ("genre", "director", "actor")
_REMARK = re.compile(r"\([^()]*\)")


@dataclass
class MeluReport:
    """What :func:`convert_melu` wrote.

    Attributes:
        src, out_dir: input and output folders.
        schema: the shared schema.
        protocol, min_ratings, max_ratings, query_count, seed, valid_fraction: the rules
            applied (after overrides).
        rows, users: per state, rows and users written.
        query_rows: per state, rows of the fixed query sets (0 without a fixed split).
        users_filtered: per state, users dropped by ``min_ratings`` / ``max_ratings``.
        users_below, users_above: per state, the users dropped for fewer than
            ``min_ratings`` or more than ``max_ratings`` ratings.
        unknown_values: per attribute, values mapped to the reserved id 0.
        paths: per state, the files written.
    """

    src: str
    out_dir: str
    schema: FeatureSchema
    protocol: str = "all"
    min_ratings: int = 1
    max_ratings: int | None = None
    query_count: int = 0
    seed: int = 0
    valid_fraction: float = 0.0
    rows: dict[str, int] = field(default_factory=dict)
    users: dict[str, int] = field(default_factory=dict)
    query_rows: dict[str, int] = field(default_factory=dict)
    users_filtered: dict[str, int] = field(default_factory=dict)
    users_below: dict[str, int] = field(default_factory=dict)
    users_above: dict[str, int] = field(default_factory=dict)
    unknown_values: dict[str, int] = field(default_factory=dict)
    paths: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Attrs:
    """Attribute tables indexed by raw id: single-hot ids [max id + 1] or CSR bags."""

    single: dict[str, np.ndarray]
    bags: dict[str, tuple[np.ndarray, np.ndarray]]
    known: np.ndarray  # bool [max id + 1]: the id has a record


def load_vocab(path: Path) -> dict[str, int]:
    """``m_<attr>.txt``: one value per line -> id (1 + line index; blank lines ignored).

    Raises:
        DataError: for a missing or empty file or a repeated value.
    """
    if not path.is_file():
        raise DataError("vocabulary file does not exist", path=str(path))
    vocab: dict[str, int] = {}
    for ln, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        value = line.strip()
        if not value:
            continue
        if value in vocab:
            raise DataError(f"line {ln}: value {value!r} repeats", path=str(path))
        vocab[value] = len(vocab) + 1
    if not vocab:
        raise DataError("vocabulary file is empty", path=str(path))
    return vocab


def melu_schema(
    vocabs: dict[str, dict[str, int]],
    num_users: int,
    num_items: int,
    include_ids: bool,
    binarize: bool,
    ranked: bool = False,
) -> FeatureSchema:
    """The schema shared by every converted state (``ranked``: with the ``melu_rank`` order)."""
    sparse = [SparseField(a, len(vocabs[a]) + 1, multi_hot=a in MULTI_HOT) for a in MOVIE_ATTRS + USER_ATTRS]
    if include_ids:
        sparse += [SparseField("user_id", num_users), SparseField("item_id", num_items)]
    base = FeatureSchema(dense=(), sparse=tuple(sparse), label_kind="binary" if binarize else "rating")
    return grouped_schema(base, "user", RANK_COLUMN if ranked else None)


def convert_melu(
    src: str | Path,
    out_dir: str | Path,
    *,
    states: tuple[str, ...] | list[str] = STATES,
    protocol: str = "all",
    binarize: bool = False,
    include_ids: bool = False,
    unknown: str = "reserved",
    min_ratings: int | None = None,
    max_ratings: int | None = None,
    query_count: int | None = None,
    seed: int = 0,
    valid_fraction: float = 0.0,
    rows_per_row_group: int = 8192,
    overwrite: bool = False,
    compression: str = "snappy",
) -> MeluReport:
    """Converts MeLU's states to ``<out_dir>/<state>/`` (module docstring).

    Args:
        src: the MeLU ``movielens/ml-1m`` folder.
        out_dir: output folder.
        states: which states to convert.
        protocol: ``"all"`` (every user, split left to the reader) or ``"melu"`` (MeLU's
            13..100 ratings filter and fixed 10 random query ratings).
        binarize: label = rating >= 4 (binary) instead of the rating.
        include_ids: add ``user_id`` and ``item_id`` fields.
        unknown: ``"reserved"`` (id 0, counted) or ``"error"`` for a value missing
            from its vocabulary.
        min_ratings, max_ratings: keep only users with that many ratings (None: the
            protocol's; MeLU: 13..100); others are counted.
        query_count: > 0 fixes that many random query ratings per user (the
            ``melu_rank`` column); 0 writes no split; None: the protocol's (MeLU: 10).
        seed: seeds each user's query choice and the validation users.
        valid_fraction: share of warm_state's users written to ``warm_state_valid``
            (the rest to ``warm_state_train``); 0 writes neither.
        rows_per_row_group: Parquet row group size.
        overwrite: replace existing part files.
        compression: Parquet codec of the written files (``snappy``, ``lz4``, ``zstd``,
            ``gzip``, ``none``; see :mod:`recaccel.io.format.writer`).

    Raises:
        ConfigError: on bad arguments.
        DataError: naming file, line (or user) and value for malformed input.
    """
    unknown_states = [s for s in states if s not in STATES]
    if unknown_states or not states:
        raise ConfigError(f"states must be a non-empty subset of {STATES}, got {list(states)}")
    if unknown not in ("reserved", "error"):
        raise ConfigError(f"unknown must be 'reserved' or 'error', got {unknown!r}")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    lo, hi, nq = PROTOCOLS[protocol]
    lo = lo if min_ratings is None else min_ratings
    hi = hi if max_ratings is None else max_ratings
    nq = nq if query_count is None else query_count
    _check_rules(lo, hi, nq, seed, valid_fraction, states)
    src, out = Path(src), Path(out_dir)
    vocabs = {a: load_vocab(src / f"m_{a}.txt") for a in MOVIE_ATTRS + USER_ATTRS}
    counts = dict.fromkeys(MOVIE_ATTRS + USER_ATTRS, 0)
    movies = _movies(src / "movies_extrainfos.dat", vocabs, unknown, counts)
    users = _users(src / "users.dat", vocabs, unknown, counts)
    schema = melu_schema(vocabs, users.known.shape[0], movies.known.shape[0], include_ids, binarize, nq > 0)
    report = MeluReport(
        str(src), str(out), schema, protocol, lo, hi, nq, seed, valid_fraction, unknown_values=counts
    )
    for state in states:
        user, item, rating, below, above = _state(src, state, lo, hi, users, movies)
        rank = _ranks(user, seed) if nq > 0 else None
        order = task_order(user, rank)
        user, item, rating = user[order], item[order], rating[order]
        rank = None if rank is None else rank[order]
        parts = {state: np.ones(user.shape[0], dtype=bool)}
        if state == "warm_state" and valid_fraction > 0:
            valid = np.isin(user, _valid_users(user, valid_fraction, seed))
            parts.update({"warm_state_train": ~valid, "warm_state_valid": valid})
        for name, keep in parts.items():
            cols = _columns(user[keep], item[keep], rating[keep], users, movies, include_ids, binarize)
            if rank is not None:
                cols[RANK_COLUMN] = rank[keep]
            with DatasetWriter(
                out / name, schema, rows_per_row_group, overwrite=overwrite, compression=compression
            ) as writer:
                writer.write(cols)
            report.rows[name] = int(keep.sum())
            report.users[name] = int(np.unique(user[keep]).size)
            report.query_rows[name] = nq * report.users[name]  # every kept user has > nq rows
            report.paths[name] = [str(p) for p in writer.paths]
        report.users_filtered[state] = below + above
        report.users_below[state], report.users_above[state] = below, above
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "melu.json", json.dumps(report.to_dict(), indent=2))
    return report


def _check_rules(lo: int, hi: int | None, nq: int, seed: int, valid_fraction: float, states) -> None:
    if lo < 1 or (hi is not None and hi < lo):
        raise ConfigError(f"need 1 <= min_ratings <= max_ratings, got {lo}, {hi}")
    if nq < 0:
        raise ConfigError(f"query_count must be >= 0, got {nq}")
    if nq > 0 and lo <= nq:
        raise ConfigError(f"min_ratings must exceed query_count (a support set is needed), got {lo} <= {nq}")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    if not 0.0 <= valid_fraction < 1.0:
        raise ConfigError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    if valid_fraction > 0 and "warm_state" not in states:
        raise ConfigError("valid_fraction needs warm_state among the states (validation users come from it)")


def _ranks(user: np.ndarray, seed: int) -> np.ndarray:
    """int64 [n] each row's place in its user's seeded random order (rows grouped by user).

    ``default_rng([seed, u]).permutation(n)`` lists row positions in MeLU's shuffled
    order (its ``indices``); a row's rank is its place in that list, so the last 10
    ranks are MeLU's ``indices[-10:]``, the query set.
    """
    rank = np.empty(user.shape[0], dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero(user[1:] != user[:-1]) + 1, [user.shape[0]]])
    for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()):
        perm = np.random.default_rng([seed, int(user[s])]).permutation(e - s)
        rank[s + perm] = np.arange(e - s)
    return rank


def _valid_users(user: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """The seeded ``round(fraction * users)`` validation users (int64, unordered)."""
    ids = np.unique(user)
    k = int(round(fraction * ids.size))
    if not 0 < k < ids.size:
        raise ConfigError(f"valid_fraction {fraction} of {ids.size} warm_state users leaves an empty side")
    return np.random.default_rng([seed, 1]).permutation(ids)[:k]


def _columns(user, item, rating, users: _Attrs, movies: _Attrs, include_ids: bool, binarize: bool) -> dict:
    label = rating.astype(np.float32)
    cols: dict = {"label": (label >= 4).astype(np.float32) if binarize else label, "user": user}
    for a in MOVIE_ATTRS:
        cols[a] = take_csr(*movies.bags[a], item) if a in MULTI_HOT else movies.single[a][item]
    for a in USER_ATTRS:
        cols[a] = users.single[a][user]
    if include_ids:
        cols["user_id"], cols["item_id"] = user, item
    return cols


def _state(
    src: Path, state: str, lo: int, hi: int | None, users: _Attrs, movies: _Attrs
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(user, item, rating) int64 arrays of a state in file order, and the users dropped
    for fewer than ``lo`` and for more than ``hi`` ratings."""
    x_path, y_path = src / f"{state}.json", src / f"{state}_y.json"
    x, y = _json(x_path), _json(y_path)
    if x.keys() != y.keys():
        extra = sorted(set(x) ^ set(y))[:3]
        raise DataError(f"users {extra} are in only one of {x_path.name} and {y_path.name}", path=str(y_path))
    user, item, rating = [], [], []
    below = above = 0
    for uid, movie_ids in x.items():
        ratings = y[uid]
        if not isinstance(movie_ids, list) or not isinstance(ratings, list) or len(movie_ids) != len(ratings):
            raise DataError(f"user {uid}: movie and rating lists differ in length or type", path=str(y_path))
        if len(movie_ids) < lo or (hi is not None and len(movie_ids) > hi):
            below += len(movie_ids) < lo
            above += len(movie_ids) >= lo
            continue
        u = _id(uid, users.known, x_path, f"user {uid!r}")
        user.append(np.full(len(movie_ids), u, dtype=np.int64))
        item.append(
            np.array(
                [_id(m, movies.known, x_path, f"user {uid}: movie {m!r}") for m in movie_ids], dtype=np.int64
            )
        )
        r = np.asarray(ratings)
        if r.dtype.kind not in "iu" or ((r < 1) | (r > 5)).any():
            raise DataError(
                f"user {uid}: ratings must be integers 1..5, got {ratings[:5]}...", path=str(y_path)
            )
        rating.append(r.astype(np.int64))
    if not user:
        raise DataError("no users left in this state", path=str(x_path))
    return np.concatenate(user), np.concatenate(item), np.concatenate(rating), below, above


def _id(text, known: np.ndarray, path: Path, what: str) -> int:
    try:
        i = int(text)
    except (TypeError, ValueError):
        raise DataError(f"{what} is not an integer id", path=str(path)) from None
    if not 0 <= i < known.shape[0] or not known[i]:
        raise DataError(f"{what} has no attribute record", path=str(path))
    return i


def _json(path: Path) -> dict:
    if not path.is_file():
        raise DataError("file does not exist", path=str(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"not valid JSON: {e}", path=str(path)) from None
    if not isinstance(data, dict):
        raise DataError("expected a JSON object of user id -> list", path=str(path))
    return data


def _records(path: Path, count: int) -> list[tuple[int, int, list[str]]]:
    """(line, id, fields) of a ``::``-separated file with ``count`` fields per line."""
    if not path.is_file():
        raise DataError("file does not exist", path=str(path))
    out = []
    for ln, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        f = line.rstrip("\r").split("::")
        if len(f) != count:
            raise DataError(
                f"line {ln}: expected {count} '::'-separated fields, got {len(f)}", path=str(path)
            )
        try:
            out.append((ln, int(f[0]), f))
        except ValueError:
            raise DataError(f"line {ln}: id {f[0]!r} is not an integer", path=str(path)) from None
    if not out:
        raise DataError("file has no records", path=str(path))
    return out


def _lookup(value: str, attr: str, vocabs, unknown: str, counts: dict[str, int], path: Path, ln: int) -> int:
    value = value.strip()
    if value == "N/A":
        value = "nan"  # MeLU built its vocabularies from pandas, which reads N/A as NaN
    i = vocabs[attr].get(value)
    if i is not None:
        return i
    if unknown == "error":
        raise DataError(
            f"line {ln}: {attr} value {value!r} is not in m_{attr}.txt", path=str(path), column=attr
        )
    counts[attr] += 1
    return 0


def _movies(path: Path, vocabs, unknown: str, counts: dict[str, int]) -> _Attrs:
    recs = _records(path, 11)
    size = max(i for _, i, _ in recs) + 1
    known = np.zeros(size, dtype=bool)
    rate = np.zeros(size, dtype=np.int64)
    bags: dict[str, list[list[int]]] = {a: [[] for _ in range(size)] for a in MULTI_HOT}
    for ln, i, f in recs:
        known[i] = True
        rate[i] = _lookup(f[3], "rate", vocabs, unknown, counts, path, ln)
        for attr, text in (("genre", f[5]), ("director", f[6]), ("actor", f[8])):
            ids = []
            for v in text.split(", "):
                v = _REMARK.sub("", v) if attr == "director" else v
                j = _lookup(v, attr, vocabs, unknown, counts, path, ln)
                if j not in ids:
                    ids.append(j)
            bags[attr][i] = ids
    csr = {}
    for attr, lists in bags.items():
        lengths = np.array([len(x) for x in lists], dtype=np.int64)
        offsets = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter((j for x in lists for j in x), dtype=np.int64, count=int(offsets[-1]))
        csr[attr] = (values, offsets)
    return _Attrs({"rate": rate}, csr, known)


def _users(path: Path, vocabs, unknown: str, counts: dict[str, int]) -> _Attrs:
    recs = _records(path, 5)
    size = max(i for _, i, _ in recs) + 1
    known = np.zeros(size, dtype=bool)
    single = {a: np.zeros(size, dtype=np.int64) for a in USER_ATTRS}
    for ln, i, f in recs:
        known[i] = True
        for attr, value in zip(USER_ATTRS, (f[1], f[2], f[3], f[4][:5])):
            single[attr][i] = _lookup(value, attr, vocabs, unknown, counts, path, ln)
    return _Attrs(single, {}, known)
