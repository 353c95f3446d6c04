"""Benchmark: Parquet reading throughput, recaccel vs raw pyarrow, on the same files.

Candidates, each one full pass over a task-grouped dataset, timed interleaved in one
process (median of ``repeats``):

- ``raw_pyarrow``: ``pyarrow.parquet.ParquetFile.iter_batches`` over the label, dense
  and sparse columns, nothing else, on one thread (``use_threads=False``; the ceiling
  of one decoding thread);
- ``raw_pyarrow_threads``: the same with pyarrow's default ``use_threads=True`` (columns
  decoded on every core: the ceiling of the machine);
- ``raw_pyarrow_tasks``: one-thread raw reading plus the task key column (the ceiling
  of the task reader);
- ``plain``: :class:`~recaccel.io.readers.rows.BatchReader` (validated, shuffled batches);
- ``plain_in_order``: the same without shuffling;
- ``tasks``: :class:`~recaccel.io.readers.tasks.reader.TaskReader` (validated, split, sampled, padded
  TaskBatches).

Throughput is dataset rows per second (every candidate reads every row once per pass).
Peak memory is measured separately (Linux): each candidate makes one pass in a fresh
Python interpreter, which resets its peak resident set size (``/proc/self/clear_refs``)
just before the pass and reports the peak (``VmHWM``) minus the RSS before the pass,
so Arrow's buffers, numpy and torch all count.

Data wait (``--train-steps``, default 300): the debug DLRM (``--train-config``) trains
that many steps on ``--device`` through the trainer's loader, and the run's
``data_wait_fraction`` (host time blocked waiting for the next batch over training
time, the first batch's start-up excluded) is reported.

Worker sweep (``--workers 0,1,2,...``): instead of the candidates above, rows/s of both
readers per reader-process count on generated ``--schema`` datasets (criteo_1hot, wide),
against one-thread and all-thread raw pyarrow: :mod:`recaccel.bench.data.io_workers`.

Without ``--path`` the data is generated with :func:`recaccel.io.convert.synth.generate_synthetic`
in a temporary folder and grouped with :func:`recaccel.io.convert.group_by_task.group_by_task`
by field ``C1`` (ids Zipf-skewed: a few heavy users, many light ones).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recaccel.bench.data import io_workers
from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, plot_file, write_results_markdown
from recaccel.bench.harness.timing import time_interleaved_samples
from recaccel.config import SynthConfig
from recaccel.io.convert.group_by_task import group_by_task
from recaccel.io.format.dataset import open_dataset
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.tasks.reader import TaskReader
from recaccel.plotting import pyplot, save_figure

log = logging.getLogger(__name__)


def add_args(parser) -> None:
    """``recaccel-bench io`` options."""
    parser.add_argument(
        "--path", help="a dataset, grouped by --task-field first if it has no task key (default: synthetic)"
    )
    parser.add_argument("--task-field", default="C1", help="single-hot field that groups a plain --path")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows to generate")
    parser.add_argument("--task-rows", type=int, default=64, help="mean rows per task when generating")
    parser.add_argument("--zipf-a", type=float, default=0.5, help="id skew of the generated fields")
    parser.add_argument(
        "--rows-per-row-group", type=int, default=8192, help="rows per row group of generated files"
    )
    parser.add_argument(
        "--compression", default="snappy", help="Parquet codec of the generated (or grouped) files"
    )
    parser.add_argument("--batch-size", type=int, default=4096, help="plain batch size and raw batch size")
    parser.add_argument("--tasks-per-batch", type=int, default=32, help="tasks per meta batch")
    parser.add_argument("--support-size", type=int, default=64, help="support rows per task")
    parser.add_argument("--query-size", type=int, default=32, help="query rows per task")
    parser.add_argument(
        "--read-ahead",
        type=int,
        default=2,
        help="buffers (plain) and units (tasks) loaded ahead, one thread each",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per reader (median)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument(
        "--train-steps", type=int, default=300, help="debug DLRM steps for data wait; 0 = skip"
    )
    parser.add_argument("--train-config", default="configs/debug.toml", help="config of the data-wait run")
    parser.add_argument("--device", default="auto", help="device of the data-wait run: auto | cpu | cuda")
    parser.add_argument(
        "--workers",
        help="comma-separated reader process counts, e.g. 0,1,2: rows/s per count instead of the candidates",
    )
    parser.add_argument(
        "--schema", default="criteo_1hot", help="with --workers: datasets to generate, of criteo_1hot,wide"
    )
    parser.add_argument(
        "--wide-rows", type=int, default=100_000, help="with --workers: rows of the wide schema"
    )
    parser.add_argument(
        "--shuffle-buffer-rows",
        type=int,
        default=65_536,
        help="with --workers: rows per shuffle buffer of the plain reader (a worker's unit)",
    )
    parser.add_argument(
        "--wide-buffer-rows", type=int, default=4096, help="with --workers: the same on the wide schema"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=600.0, help="with --workers: no repeat starts after this long"
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="with --workers: also time the plain reader from a pre-decoded cache of the same data",
    )
    parser.add_argument("--json", help="also write every figure, the environment and the command here")
    add_output_args(parser, "io", plot="the throughputs")


def make_dataset(
    work: Path, rows: int, task_rows: int, zipf_a: float, rows_per_row_group: int, compression: str = "snappy"
) -> Path:
    """Synthetic Criteo-like rows grouped by field C1 into ``work/tasks`` (``compression``: codec)."""
    from recaccel.io.convert.synth import generate_synthetic

    cards = [max(2, rows // task_rows)] + [100_000] * 25
    cfg = SynthConfig(
        out_dir=str(work / "synth"),
        train_rows=rows,
        test_rows=1000,
        cardinalities=cards,
        zipf_a=zipf_a,
        rows_per_row_group=rows_per_row_group,
        rows_per_file=max(rows // 4, 1),
        compression=compression,
    )
    generate_synthetic(cfg)
    group_by_task(
        work / "synth" / "train",
        work / "tasks",
        task_key="C1",
        rows_per_row_group=rows_per_row_group,
        rows_per_file=max(rows // 4, 1),
        compression=compression,
    )
    return work / "tasks"


def candidates(path: Path, args) -> dict:
    """name -> zero-argument callable making one pass; returns rows read."""
    info = open_dataset(path)
    schema = info.schema
    plain_cols = [schema.label, *schema.dense, *schema.sparse_names]
    task_cols = plain_cols + [schema.task_key] + ([schema.timestamp] if schema.timestamp else [])
    tcfg = io_workers.tasks_config(args)

    def raw(columns, threads=False):
        n = 0
        for f in info.files:
            with pq.ParquetFile(str(f)) as pf:
                for batch in pf.iter_batches(
                    batch_size=args.batch_size, columns=columns, use_threads=threads
                ):
                    n += batch.num_rows
        return n

    def plain(shuffle: bool):
        reader = BatchReader(
            path,
            args.batch_size,
            ReadOptions(seed=0, shuffle=shuffle, read_ahead=args.read_ahead),
            shuffle_buffer_rows=65_536,
        )
        for _ in reader:
            pass
        return reader.counters["rows_read"]

    def tasks():
        reader = TaskReader(path, tcfg, ReadOptions(seed=0, read_ahead=args.read_ahead))
        for _ in reader:
            pass
        return reader

    return {
        "raw_pyarrow": lambda: raw(plain_cols),
        "raw_pyarrow_threads": lambda: raw(plain_cols, threads=True),
        "raw_pyarrow_tasks": lambda: raw(task_cols),
        "plain": lambda: plain(True),
        "plain_in_order": lambda: plain(False),
        "tasks": tasks,
    }


def _peak_rss_child(path: str, args_json: str, name: str, out_file: str) -> None:
    """Runs in a fresh interpreter: one pass of ``name``, peak RSS growth (MiB) to ``out_file``."""
    args = type("Args", (), json.loads(args_json))
    run = candidates(Path(path), args)[name]
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    run()
    Path(out_file).write_text(str((_status_kib("VmHWM") - before) / 1024))


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


def peak_memory_mib(path: Path, args, names: list[str]) -> dict[str, float]:
    """Peak RSS growth (MiB) of one pass per candidate, each in a fresh interpreter."""
    keys = ("batch_size", "tasks_per_batch", "support_size", "query_size", "read_ahead")
    args_json = json.dumps({k: getattr(args, k) for k in keys})
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            result = Path(tmp) / f"{name}.txt"
            code = (
                "from recaccel.bench.data.io import _peak_rss_child; "
                f"_peak_rss_child({str(path)!r}, {args_json!r}, {name!r}, {str(result)!r})"
            )
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                log.warning("memory pass of %s failed: %s", name, proc.stderr[-2000:])
                out[name] = float("nan")
            else:
                out[name] = float(result.read_text())
    return out


def _rows_of(result) -> int:
    """Rows one pass read: a raw or plain pass returns them, a tasks pass its reader."""
    return result if isinstance(result, int) else int(result.counters["rows_read"])


def run_io_bench(path: Path, args) -> tuple[list[dict], list[str]]:
    """Times the candidates on ``path``; returns table rows and notes."""
    info = open_dataset(path)
    cands = candidates(path, args)
    last = {}
    counts: dict[str, set[int]] = {n: set() for n in cands}

    def timed(name):
        def call():
            last[name] = cands[name]()
            counts[name].add(_rows_of(last[name]))

        return call

    load_before = os.getloadavg()[0]
    samples = time_interleaved_samples({n: timed(n) for n in cands}, args.repeats, 1, "cpu")
    load_after = os.getloadavg()[0]
    io_workers.check_whole_passes(counts, info.num_rows)
    memory = {} if args.no_memory else peak_memory_mib(path, args, list(cands))
    rows = info.num_rows
    med = {n: sorted(s)[len(s) // 2] / 1e3 for n, s in samples.items()}
    reader = last["tasks"]
    table = []
    for name in cands:
        ceiling = "raw_pyarrow_tasks" if name == "tasks" else "raw_pyarrow"
        row = {
            "candidate": name,
            "median_s": med[name],
            "min_s": min(samples[name]) / 1e3,
            "rows_per_s": rows / med[name],
            "vs_raw_pyarrow": med[ceiling] / med[name],
            "vs_raw_threads": med["raw_pyarrow_threads"] / med[name],
            "peak_rss_mib": memory.get(name),
        }
        if name == "tasks":
            row["tasks_per_s"] = reader.counters["tasks_yielded"] / med[name]
        table.append(row)
    codec = pq.ParquetFile(info.files[0]).metadata.row_group(0).column(0).compression
    notes = [
        f"dataset: {path} ({rows} rows, {len(info.files)} files, {len(info.row_groups)} row groups, "
        f"{codec} compression, "
        f"{len(info.schema.dense)} dense + {len(info.schema.sparse)} sparse columns)",
        "Candidates timed interleaved within each repeat (order rotating); median of "
        f"{args.repeats} passes after one warm-up pass. Throughput = dataset rows / pass time "
        "(every pass checked to read every row).",
        "vs_raw_pyarrow: the candidate's throughput over one-thread raw iter_batches of the same "
        "columns (the task reader is compared with raw reading including the task key column); "
        "vs_raw_threads: over raw iter_batches with pyarrow's default use_threads=True. "
        "Targets: plain >= 0.8, tasks >= 0.5.",
        f"recaccel readers: read_ahead={args.read_ahead} (buffers or units decoded ahead, one worker "
        "thread each, every row group decoded with Arrow's threads), page checksums verified, "
        "every value validated.",
        f"tasks: T={args.tasks_per_batch}, S={args.support_size}, Q={args.query_size}, "
        f"shuffle_buffer_tasks=1024; stats of the last pass: "
        f"{_task_stats(reader)}",
        f"machine: {os.cpu_count()} CPUs; 1-minute load average {load_before:.2f} before and "
        f"{load_after:.2f} after the timed passes (other work on the machine slows every candidate).",
        "peak_rss_mib: peak resident set growth of one pass in a fresh Python process "
        "(VmHWM after the pass, reset before it, minus VmRSS before it).",
    ]
    return table, notes


def measure_data_wait(work: Path, args) -> tuple[dict, str, str]:
    """Trains the debug DLRM ``args.train_steps`` steps on its synthetic data in ``work``.

    Returns:
        A table row, a note, and the device it ran on.

    Raises:
        ConfigError: if ``args.train_config`` cannot be read.
    """
    from recaccel.api import train
    from recaccel.config import load_config
    from recaccel.io.convert.synth import generate_synthetic
    from recaccel.train.loop.trainer import resolve_device

    cfg = load_config(
        args.train_config,
        [
            f'synth.out_dir="{work / "data"}"',
            f'data.train="{work / "data" / "train"}"',
            f'data.test="{work / "data" / "test"}"',
            f'train.out_dir="{work / "run"}"',
            f"train.steps={args.train_steps}",
            f'train.device="{args.device}"',
            "train.progress=false",
        ],
    )
    device = str(resolve_device(cfg.train.device))
    generate_synthetic(cfg.synth)
    metrics = train(cfg)
    row = {
        "candidate": f"debug_dlrm_train ({device})",
        "rows_per_s": metrics["samples_per_s"],
        "data_wait_fraction": metrics["data_wait_fraction"],
    }
    note = (
        f"debug_dlrm_train: {args.train_config} for {metrics['steps']} steps of batch "
        f"{cfg.data.batch_size} on {device} through the trainer's DeviceLoader (prefetch "
        f"{cfg.data.prefetch}); data_wait_fraction = host time blocked on the next batch / training "
        f"time, after the first batch (start-up {metrics['data_startup_s']:.2f} s excluded; steady "
        f"wait {metrics['data_wait_s']:.3f} s). Target on GPU: < 0.02."
    )
    return row, note, device


def plot_throughput(table: list[dict], path: str | Path) -> Path:
    """Horizontal bars of rows/s per reading candidate (median; the whisker reaches the
    best pass), with the targets as dashed lines."""
    plt = pyplot()

    rows = [r for r in table if r.get("median_s")]
    per_s = {r["candidate"]: r["rows_per_s"] for r in rows}
    best = [r["rows_per_s"] * r["median_s"] / r["min_s"] - r["rows_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.0, 0.5 * len(rows) + 1.5))
    pos = list(range(len(rows)))
    colors = ["tab:grey" if r["candidate"].startswith("raw") else "tab:blue" for r in rows]
    ax.barh(
        pos,
        [r["rows_per_s"] / 1e6 for r in rows],
        xerr=[[0] * len(rows), [b / 1e6 for b in best]],
        color=colors,
        capsize=3,
    )
    ax.set_yticks(pos, [r["candidate"] for r in rows])
    ax.invert_yaxis()
    for share, ceiling, style in ((0.8, "raw_pyarrow", "--"), (0.5, "raw_pyarrow_tasks", ":")):
        if ceiling in per_s:
            ax.axvline(
                share * per_s[ceiling] / 1e6,
                color="tab:red",
                linestyle=style,
                label=f"target: {share:g} x {ceiling}",
            )
    ax.set_xlabel("million rows / s (median pass; whisker: best pass)")
    ax.set_title("Parquet reading throughput, same files, one run")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def _task_stats(reader: TaskReader) -> str:
    keys = (
        "tasks_yielded",
        "tasks_skipped_small",
        "tasks_subsampled",
        "rows_read",
        "row_groups_read",
        "max_buffered_rows",
    )
    return ", ".join(f"{k}={reader.counters[k]}" for k in keys)


def main(args, command_line: str) -> Path:
    """Runs the benchmark and writes ``args.out`` (and ``args.json``); returns its path."""
    sweep = args.workers is not None
    if sweep:  # bad values fail before any data is written
        io_workers.parse_workers(args.workers)
        io_workers.parse_schemas(args.schema)
    with tempfile.TemporaryDirectory(prefix="recaccel-bench-io-") as tmp:
        if sweep:
            table, notes = io_workers.run_sweep(Path(tmp), args)
        else:
            table, notes = run_io_bench(_candidates_dataset(Path(tmp), args), args)
        plot = plot_file(args)
        if plot is not None:
            (io_workers.plot_workers if sweep else plot_throughput)(table, plot)
        device, failure = "cpu", None
        if args.train_steps > 0:
            try:
                row, note, device = measure_data_wait(Path(tmp) / "train", args)
                table.append(row)
                notes.append(note)
            except Exception as e:  # the reading results stand; the failure is reported and raised
                failure = e
                notes.append(f"debug_dlrm_train FAILED ({type(e).__name__}: {e}); no data-wait figure")
    env = {
        **environment_info("cpu" if failure else device),
        "cpus": os.cpu_count(),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
    }
    title = "Parquet reading by reader processes" if sweep else "Parquet reading: recaccel vs raw pyarrow"
    out = write_results_markdown(args.out, title, env, command_line, table, notes)
    if args.json:
        doc = {"environment": env, "command": command_line, "results": table, "notes": notes}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    log.info("wrote %s", out)
    if failure is not None:
        raise failure
    return Path(out)


def _candidates_dataset(work: Path, args) -> Path:
    """The task-grouped dataset of the candidates comparison: ``--path`` (grouped by
    ``--task-field`` first when it has no task key) or generated in ``work``."""
    if args.path is None:
        return make_dataset(
            work, args.rows, args.task_rows, args.zipf_a, args.rows_per_row_group, args.compression
        )
    if open_dataset(args.path).schema.task_key is None:
        path = work / "tasks"
        group_by_task(
            args.path,
            path,
            task_key=args.task_field,
            rows_per_row_group=args.rows_per_row_group,
            compression=args.compression,
        )
        return path
    return Path(args.path)
