"""``recaccel-bench io --workers 0,1,2,...``: reader rows/s per worker-process count.

For each schema (``--schema criteo_1hot,wide``) a dataset is written straight from
random arrays (no planted model: only the bytes matter to reading speed), then these
candidates make full passes over it, timed interleaved (order rotating per repeat):

- ``raw_pyarrow``, ``raw_pyarrow_threads``: ``iter_batches`` of the label, dense and
  sparse columns at the same batch size, on one thread and on all of them;
- ``plain`` at each worker count: :class:`~recaccel.io.readers.rows.BatchReader` with
  ``ReadOptions(workers=N)`` (shuffled, validated batches);
- ``tasks`` at each worker count, on a schema with a task key (criteo_1hot):
  :class:`~recaccel.io.readers.tasks.reader.TaskReader`;
- ``plain_cache`` at each worker count (``--cache``): the plain reader from a
  pre-decoded cache of the same dataset (the same batches; its build is timed apart);
  ``tasks_cache`` beside it where the schema has a task key: the task reader from it.

Throughput is dataset rows over the whole pass (worker start-up included: paid once per
epoch); ``startup_s`` is the time to the first batch. ``speedup_vs_1_worker`` divides by
the same reader's figure at one worker (``vs_in_process``: at none), ``vs_raw_pyarrow`` / ``vs_raw_threads`` by the
raw candidates', ``tasks_vs_plain`` by plain at the same worker count (``tasks_cache``:
by ``plain_cache``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from recaccel.config import TasksConfig
from recaccel.errors import ConfigError, RecaccelError
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import DatasetWriter
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.tasks.reader import TaskReader
from recaccel.plotting import pyplot, save_figure
from recaccel.train.run.console import console

# name -> (sparse one-hot fields, ids per field, with a task key): the two schemas.
SCHEMAS = {"criteo_1hot": (26, 100_000, True), "wide": (500, 50_000, False)}
NUM_DENSE = 13
RAW = ("raw_pyarrow", "raw_pyarrow_threads")


def tasks_config(args) -> TasksConfig:
    """The task batches both io benchmarks read: the command's sizes, small tasks allowed."""
    return TasksConfig(
        tasks_per_batch=args.tasks_per_batch,
        support_size=args.support_size,
        query_size=args.query_size,
        min_task_rows=2,
        shuffle_buffer_tasks=1024,
    )


def parse_workers(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``.

    Raises:
        ConfigError: on an empty list, a non-integer or a negative count.
    """
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise ConfigError(f"io bench: --workers must be comma-separated counts >= 0, got {text!r}")
    return list(dict.fromkeys(counts))


def parse_schemas(text: str) -> list[str]:
    """``"criteo_1hot,wide"`` -> the names, each one of :data:`SCHEMAS`.

    Raises:
        ConfigError: naming an unknown schema.
    """
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEMAS]
    if bad or not names:
        raise ConfigError(f"io bench: --schema must list {', '.join(SCHEMAS)}, got {text!r}")
    return names


def write_dataset(
    out: Path, schema_name: str, rows: int, task_rows: int, rows_per_row_group: int, compression: str
) -> Path:
    """Random rows of ``schema_name`` (13 dense + one-hot fields, sorted task key where
    the schema has one) written as a recaccel dataset in ``out``; returns ``out``."""
    fields, cardinality, tasks = SCHEMAS[schema_name]
    schema = FeatureSchema(
        dense=tuple(f"I{i + 1}" for i in range(NUM_DENSE)),
        sparse=tuple(SparseField(f"C{i + 1}", cardinality) for i in range(fields)),
        task_key="task" if tasks else None,
    )
    rng = np.random.default_rng(0)
    with DatasetWriter(
        out, schema, rows_per_row_group, max(rows // 4, rows_per_row_group), compression=compression
    ) as writer:
        for start in range(0, rows, rows_per_row_group):
            n = min(rows_per_row_group, rows - start)
            cols = {schema.label: (rng.random(n) < 0.25).astype(np.float32)}
            cols.update({name: rng.standard_normal(n, dtype=np.float32) for name in schema.dense})
            # Squared uniforms: a skew toward small ids, as real id columns have.
            cols.update(
                {name: (cardinality * rng.random(n) ** 2).astype(np.int64) for name in schema.sparse_names}
            )
            if tasks:
                cols["task"] = np.arange(start, start + n, dtype=np.int64) // task_rows
            writer.write(cols)
    return out


def timed_pass(batches: Callable[[], Iterable]) -> tuple[float, float, int | None]:
    """One full pass over ``batches()``: (seconds to the first batch, seconds in all, rows
    read by a recaccel reader (its counters, after the clock stops); None for raw pyarrow)."""
    t0 = time.perf_counter()
    first = None
    source = batches()
    for _ in source:
        if first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    counters = getattr(source, "counters", None)
    return (
        (total if first is None else first),
        total,
        None if counters is None else int(counters["rows_read"]),
    )


def check_whole_passes(counts: dict, rows: int) -> None:
    """Every pass of every candidate read all ``rows``: throughput is dataset rows / pass time.

    Args:
        counts: candidate -> the set of row counts its passes read.

    Raises:
        RecaccelError: one line naming the candidate and what its passes read.
    """
    for name, seen in counts.items():
        if seen != {rows}:
            raise RecaccelError(
                f"io bench: candidate {name!r} read {', '.join(map(str, sorted(seen)))} rows per pass, "
                f"the dataset has {rows}: its throughput would be wrong"
            )


def sweep_candidates(
    path: Path, args, counts: list[int], buffer_rows: int, cache: Path | None = None
) -> dict[tuple[str, int | None], Callable]:
    """(candidate, workers) -> zero-argument callable returning one pass's batch iterable
    (the plain reader's shuffle buffers of ``buffer_rows`` rows)."""
    info = open_dataset(path)
    schema = info.schema
    columns = [schema.label, *schema.dense, *schema.sparse_names]

    def raw(threads: bool):
        for f in info.files:
            with pq.ParquetFile(str(f)) as pf:
                yield from pf.iter_batches(batch_size=args.batch_size, columns=columns, use_threads=threads)

    def plain(workers: int, source: Path = path):
        options = ReadOptions(seed=0, read_ahead=args.read_ahead, workers=workers)
        return BatchReader(source, args.batch_size, options, shuffle_buffer_rows=buffer_rows)

    tasks_cfg = tasks_config(args)

    def tasks(workers: int, source: Path = path):
        return TaskReader(source, tasks_cfg, ReadOptions(seed=0, read_ahead=args.read_ahead, workers=workers))

    cands: dict[tuple[str, int | None], Callable] = {
        ("raw_pyarrow", None): lambda: raw(False),
        ("raw_pyarrow_threads", None): lambda: raw(True),
    }
    for n in counts:
        cands[("plain", n)] = lambda n=n: plain(n)
    for n in counts if cache is not None else ():
        cands[("plain_cache", n)] = lambda n=n: plain(n, cache)
    if schema.task_key is not None:
        for n in counts:
            cands[("tasks", n)] = lambda n=n: tasks(n)
        for n in counts if cache is not None else ():
            cands[("tasks_cache", n)] = lambda n=n: tasks(n, cache)
    return cands


def time_sweep(cands: dict, repeats: int, max_seconds: float) -> dict[tuple, list[tuple[float, float]]]:
    """Passes of every candidate, interleaved with the order rotating per repeat; stops
    after the repeat that passes ``max_seconds`` (at least one). Returns the samples."""
    keys = list(cands)
    _start_worker_server(cands)
    samples: dict[tuple, list[tuple[float, float]]] = {k: [] for k in keys}
    t0 = time.monotonic()
    for r in range(repeats):
        for i in range(len(keys)):
            key = keys[(r + i) % len(keys)]
            samples[key].append(timed_pass(cands[key]))
        if time.monotonic() - t0 > max_seconds:
            break
    return samples


def _start_worker_server(cands: dict) -> None:
    """One batch of the first reader with workers, untimed: the process server that
    starts workers comes up once per interpreter, not once per epoch."""
    key = next((k for k in cands if k[1]), None)
    if key is not None:
        batches = iter(cands[key]())
        next(batches, None)
        getattr(batches, "close", lambda: None)()


def sweep_rows(schema_name: str, rows: int, samples: dict[tuple, list[tuple[float, float]]]) -> list[dict]:
    """Table rows of one schema: medians, rows/s and the ratios of the module docstring."""
    med = {k: statistics.median(s[1] for s in v) for k, v in samples.items()}
    rate = {k: rows / s for k, s in med.items()}
    out = []
    for (name, workers), seconds in med.items():
        one, in_process = rate.get((name, 1)), rate.get((name, 0))
        plain = rate.get(("plain_cache" if name == "tasks_cache" else "plain", workers))
        out.append(
            {
                "schema": schema_name,
                "candidate": name,
                "workers": workers,
                "repeats": len(samples[(name, workers)]),
                "median_s": seconds,
                "startup_s": statistics.median(s[0] for s in samples[(name, workers)]),
                "rows_per_s": rate[(name, workers)],
                "speedup_vs_1_worker": rate[(name, workers)] / one if one and workers is not None else None,
                "vs_in_process": rate[(name, workers)] / in_process
                if in_process and workers is not None
                else None,
                "vs_raw_pyarrow": rate[(name, workers)] / rate[("raw_pyarrow", None)],
                "vs_raw_threads": rate[(name, workers)] / rate[("raw_pyarrow_threads", None)],
                "tasks_vs_plain": rate[(name, workers)] / plain
                if name.startswith("tasks") and plain
                else None,
            }
        )
    return out


def plot_workers(table: list[dict], path: str | Path) -> Path:
    """rows/s against worker count, one line per schema and reader, the raw pyarrow
    ceilings of each schema as horizontal lines."""
    plt = pyplot()
    schemas = list(dict.fromkeys(r["schema"] for r in table))
    fig, axes = plt.subplots(1, len(schemas), figsize=(5.5 * len(schemas), 4.0), squeeze=False)
    for ax, schema in zip(axes[0], schemas):
        rows = [r for r in table if r["schema"] == schema]
        for name, marker in (("plain", "o"), ("tasks", "s"), ("plain_cache", "^"), ("tasks_cache", "v")):
            points = sorted((r["workers"], r["rows_per_s"] / 1e6) for r in rows if r["candidate"] == name)
            if points:
                ax.plot(*zip(*points), marker=marker, label=f"{name} reader")
        for raw, style in zip(RAW, ("--", ":")):
            for r in rows:
                if r["candidate"] == raw:
                    ax.axhline(r["rows_per_s"] / 1e6, color="tab:grey", linestyle=style, label=raw)
        ax.set_xticks(sorted({r["workers"] for r in rows if r["workers"] is not None}))
        ax.set_ylim(bottom=0)
        ax.set_xlabel("data.workers (0 = in the training process)")
        ax.set_ylabel("million dataset rows / s (median pass)")
        ax.set_title(f"{schema}: reader rows/s by worker processes")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def dataset_rows(schema_name: str, args) -> int:
    """Rows generated for ``schema_name``: ``--wide-rows`` for the wide one, else ``--rows``."""
    return args.wide_rows if schema_name == "wide" else args.rows


def buffer_rows(schema_name: str, args) -> int:
    """Rows per shuffle buffer (the unit a worker decodes): ``--wide-buffer-rows`` for the
    wide schema, whose rows are 13 times as wide, so that a dataset that fits the time
    budget still has a few buffers per worker; else ``--shuffle-buffer-rows``."""
    return args.wide_buffer_rows if schema_name == "wide" else args.shuffle_buffer_rows


def run_sweep(work: Path, args) -> tuple[list[dict], list[str]]:
    """The worker sweep over ``--path`` or each ``--schema`` (generated in ``work``).

    Returns:
        Table rows (one per schema, candidate and worker count) and notes.
    """
    counts = parse_workers(args.workers)
    if args.path is not None:
        datasets = {"path": Path(args.path)}
    else:
        datasets = {}
        for name in parse_schemas(args.schema):
            t0, rows = time.monotonic(), dataset_rows(name, args)
            group = min(args.rows_per_row_group, buffer_rows(name, args))
            datasets[name] = write_dataset(work / name, name, rows, args.task_rows, group, args.compression)
            console.info("io: %s: %d rows written in %.1f s", name, rows, time.monotonic() - t0)
    table, notes = [], []
    for name, path in datasets.items():
        t0 = time.monotonic()
        info = open_dataset(path)
        load_before = _load()
        buffer = buffer_rows(name, args)
        cache = _build_cache(path, work / f"{name}.cache", notes) if getattr(args, "cache", False) else None
        samples = time_sweep(
            sweep_candidates(path, args, counts, buffer, cache), args.repeats, args.max_seconds
        )
        read = {
            f"{c} at {n} workers": {s[2] for s in v} for (c, n), v in samples.items() if v[0][2] is not None
        }
        check_whole_passes(read, info.num_rows)
        table += sweep_rows(name, info.num_rows, samples)
        console.info(
            "io: %s: %d passes timed in %.1f s", name, sum(map(len, samples.values())), time.monotonic() - t0
        )
        notes.append(f"{_dataset_note(name, info, buffer, args.compression)}; 1-minute load average "
                     f"{load_before:.2f} before and {_load():.2f} after its passes")  # fmt: skip
    notes += [
        f"workers {counts}: reader processes (data.workers; 0 = in this process), read_ahead="
        f"{args.read_ahead}, batch {args.batch_size} rows (raw pyarrow too); tasks: "
        f"T={args.tasks_per_batch}, S={args.support_size}, Q={args.query_size}.",
        f"Passes timed interleaved, order rotating per repeat, up to {args.repeats} repeats "
        f"(fewer once {args.max_seconds:g} s are spent; column repeats), no warm-up: the data was "
        "just written (page cache warm). rows_per_s = dataset rows / whole pass, worker start-up "
        "included (startup_s: time to the first batch, paid once per epoch).",
        "speedup_vs_1_worker / vs_in_process: over the same reader at workers=1 / workers=0; vs_raw_pyarrow / vs_raw_threads: "
        "over iter_batches of the same columns and batch size on one thread / all threads; "
        "tasks_vs_plain: over plain at the same worker count (tasks_cache: over plain_cache).",
    ]
    return table, notes


def _dataset_note(name: str, info, buffer: int, compression: str) -> str:
    groups = info.row_groups
    return (
        f"{name}: {info.num_rows} rows, {len(info.files)} files, {len(groups)} row groups of "
        f"{groups[0].num_rows if groups else 0} rows, shuffle buffers of {buffer} rows, {compression}, "
        f"{len(info.schema.dense)} dense + {len(info.schema.sparse)} one-hot sparse columns"
        + (", task key" if info.schema.task_key else "")
    )


def _build_cache(path: Path, dst: Path, notes: list[str]) -> Path:
    """A pre-decoded cache of ``path`` in ``dst``; its build time goes to ``notes``."""
    from recaccel.io.format.cache.build import build_cache

    report = build_cache(path, dst)
    notes.append(
        f"cache of {path.name}: {report.rows} rows, {report.bytes / 2**20:.1f} MiB of column files, "
        f"built in {report.seconds:.2f} s (once; not in the plain_cache / tasks_cache passes)"
    )
    return dst


def _load() -> float:
    return os.getloadavg()[0]
