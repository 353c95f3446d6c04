"""Id traces for ``recaccel-bench cache``: seeded Zipf ids and real id columns.

A trace is named by a spec:

- ``zipf-S``: ids drawn from a Zipf law of exponent S (``P(rank r) ~ r^-S`` over the
  table's rows, ranks scattered over the ids by a seeded permutation);
- ``criteo-CJ``: categorical column J (1..26) of the Criteo Kaggle 10k-line sample, in
  file order; hex values numbered in order of first appearance from 1, a missing value
  is row 0 (as :mod:`recaccel.io.convert.criteo` reserves it);
- ``movielens-user`` / ``movielens-item``: the user or item ids of MovieLens 100K's
  ``u.data``, in file order, numbered in order of first appearance.

Real traces are read from the shared data folder (``../shared/data``); their datasets
may not be copied into the repository, so a missing file is reported, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recaccel.bench.cache.policies import Trace
from recaccel.errors import ConfigError

DEFAULT_TRACES = ("zipf-0.8", "zipf-1.05", "zipf-1.2", "criteo-C3", "movielens-user", "movielens-item")
CRITEO_FILE = Path("criteo-kaggle-head10k") / "train_examples.txt"
MOVIELENS_FILE = Path("movielens-100k") / "u.data"
_CRITEO_DENSE = 13  # label, then 13 integer features, then the 26 categorical ones


@dataclass(frozen=True)
class TraceSizes:
    """How big the generated and real traces are.

    Attributes:
        zipf_rows: Rows of the Zipf table.
        zipf_batch: Ids per Zipf batch.
        zipf_batches: Zipf batches.
        real_batch: Rows (so ids) per batch of a real trace.
        seed: Seed of the Zipf draws.
    """

    zipf_rows: int = 1_000_000
    zipf_batch: int = 4096
    zipf_batches: int = 300
    real_batch: int = 64
    seed: int = 0


class MissingData(Exception):
    """A real trace's file is absent (not an error: the dataset lives outside the repository)."""


def zipf_trace(exponent: float, sizes: TraceSizes) -> Trace:
    """``sizes.zipf_batches`` batches of ``sizes.zipf_batch`` ids, Zipf of ``exponent``."""
    if exponent <= 0:
        raise ConfigError(f"cache trace zipf-{exponent}: the exponent must be > 0")
    rng = np.random.default_rng(sizes.seed)
    cdf = np.cumsum(np.arange(1, sizes.zipf_rows + 1, dtype=np.float64) ** -exponent)
    draws = rng.random(sizes.zipf_batch * sizes.zipf_batches) * cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, draws, side="right"), sizes.zipf_rows - 1)
    ids = rng.permutation(sizes.zipf_rows)[ranks].reshape(sizes.zipf_batches, sizes.zipf_batch)
    return Trace.from_ids(
        f"zipf-{exponent:g}",
        sizes.zipf_rows,
        list(ids),
        f"Zipf exponent {exponent:g} over {sizes.zipf_rows} rows, {sizes.zipf_batches} batches of "
        f"{sizes.zipf_batch} ids, seed {sizes.seed}",
    )


def _number(values: list[str], missing: str | None) -> tuple[np.ndarray, int]:
    """Values -> dense ids in order of first appearance (from 1 when ``missing`` takes 0)."""
    start = 0 if missing is None else 1
    table: dict[str, int] = {}
    ids = [0 if v == missing else table.setdefault(v, start + len(table)) for v in values]
    return np.asarray(ids, dtype=np.int64), start + len(table)


def _batched(name: str, ids: np.ndarray, rows: int, batch: int, what: str) -> Trace:
    if batch < 1:
        raise ConfigError(f"cache bench: --real-batch must be >= 1, got {batch}")
    batches = [ids[s : s + batch] for s in range(0, len(ids), batch)]
    return Trace.from_ids(name, rows, batches, f"{what}, file order, {len(batches)} batches of {batch} rows")


def criteo_trace(column: int, data: Path, batch: int) -> Trace:
    """Categorical column ``column`` (1..26) of the Criteo sample, ``batch`` lines per batch."""
    if not 1 <= column <= 26:
        raise ConfigError(f"cache trace criteo-C{column}: the column must be 1..26")
    path = data / CRITEO_FILE
    if not path.is_file():
        raise MissingData(f"{path} is absent")
    field = _CRITEO_DENSE + column
    with path.open() as f:
        values = [line.rstrip("\n").split("\t")[field] for line in f]
    ids, rows = _number(values, missing="")
    what = f"Criteo Kaggle sample ({len(values)} lines) column C{column}: {rows - 1} values + missing = row 0"
    return _batched(f"criteo-C{column}", ids, rows, batch, what)


def movielens_trace(column: str, data: Path, batch: int) -> Trace:
    """The ``user`` or ``item`` ids of MovieLens 100K's ratings, ``batch`` ratings per batch."""
    path = data / MOVIELENS_FILE
    if not path.is_file():
        raise MissingData(f"{path} is absent")
    index = {"user": 0, "item": 1}[column]
    with path.open() as f:
        values = [line.split("\t")[index] for line in f if line.strip()]
    ids, rows = _number(values, missing=None)
    what = f"MovieLens 100K u.data ({len(values)} ratings) {column} ids: {rows} rows"
    return _batched(f"movielens-{column}", ids, rows, batch, what)


def load_trace(spec: str, sizes: TraceSizes, data: Path) -> Trace:
    """The trace a spec names (see the module docstring).

    Raises:
        ConfigError: an unknown spec.
        MissingData: a real trace's file is absent.
    """
    kind, _, arg = spec.partition("-")
    try:
        if kind == "zipf":
            return zipf_trace(float(arg), sizes)
        if kind == "criteo" and arg[:1] == "C":
            return criteo_trace(int(arg[1:]), data, sizes.real_batch)
    except ValueError:
        pass
    if kind == "movielens" and arg in ("user", "item"):
        return movielens_trace(arg, data, sizes.real_batch)
    raise ConfigError(
        f"cache bench: unknown trace {spec!r} (zipf-<exponent>, criteo-C<1..26>, movielens-user, movielens-item)"
    )
