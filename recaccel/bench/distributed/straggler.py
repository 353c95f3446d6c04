"""Benchmark: hybrid training with one rank slowed, with and without straggler mitigation.

``recaccel-bench straggler`` (issue 17) trains one DLRM in hybrid mode (TorchRec
table-wise sharded embeddings, data-parallel dense MLPs) on W gloo ranks on CPU, one
process per rank spawned here, over a synthetic Parquet dataset, one epoch per scenario:

- ``clean``: no slow rank (``parallel.data = "global"``);
- ``clean_dynamic``: no slow rank, ``parallel.data = "dynamic"`` (``backup``'s baseline);
- ``slowed``: rank W-1 slowed ``--slow-factor`` x, no mitigation;
- ``rebalance``: slowed, ``parallel.straggler = "rebalance"`` (global data);
- ``backup``: slowed, ``parallel.straggler = "backup"`` (``parallel.data = "dynamic"``).

The slow rank is slowed by ``fault.slow_rank``: when its pooled embeddings' gradient is
ready (before the backward all-to-all) it sleeps ``factor - 1`` times its own compute of
the step, so it is ``factor`` times slower per row whatever its share, its delay overlaps
the other ranks' compute as a slower device's would, and the monitor (and the straggler
controllers reading it) count the sleep as its compute.

Every scenario runs in the same process group, one after the other, in ``--repeats``
rounds (interleaved: drift on a shared machine hits all alike; samples/s is the median
over rounds). The communication
monitor runs in all of them (``monitor.every`` steps between gathers); the step at which
the ``slowed`` run's metrics.json first flags the slow rank is ``detect_steps``.

Row identity: dense column 0 holds ``row_index / 1024`` (exact in float32). Each rank
records, through a step observer (``BatchCallback``), the time and the row ids of every
local batch it trains; the parent counts each epoch's rows (lost: never trained,
repeated: trained more than once) and times samples/s on rank 0's step starts (ranks
start a step together, after the step's agreement), after ``--warmup`` steps.

Targets (issue 17): mitigation recovers >= 85% of the clean samples/s; the slow rank
flagged within 20 steps; zero rows lost or repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from recaccel.bench.distributed.local_group import free_port, join_local_gloo
from recaccel.bench.distributed.straggler_report import SCENARIOS, analyse, write_markdown, write_plot
from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, plot_file
from recaccel.errors import ConfigError, RecaccelError

ROW_SCALE = 1024.0  # dense column 0 = row index / ROW_SCALE
DENSE, SPARSE, VOCAB = 13, 4, 4000  # dense columns (row_id first), sparse fields, their cardinality


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="W gloo ranks (>= 2; default 4)")
    parser.add_argument("--rows", type=int, default=262_144, help="training rows (one epoch per scenario)")
    parser.add_argument(
        "--batch", type=int, default=1024, help="rows per rank per step (global batch: W x this)"
    )
    parser.add_argument("--slow-factor", type=float, default=2.0, help="the slow rank's compute, times this")
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps of each scenario")
    parser.add_argument(
        "--repeats", type=int, default=2, help="rounds of all scenarios (interleaved; samples/s: the median)"
    )
    parser.add_argument("--mlp", type=int, default=512, help="width of the dense MLPs (compute per row)")
    parser.add_argument("--monitor-every", type=int, default=2, help="monitor.every (steps between gathers)")
    parser.add_argument("--monitor-slow-steps", type=int, default=3, help="monitor.slow_steps")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for all scenarios together")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model")
    parser.add_argument("--json", help="also write the results as JSON here")
    add_output_args(parser, "straggler", plot="samples/s per scenario and step times of the slowed runs")


def check_args(args) -> list[str]:
    """The scenarios to run, after checking the flags.

    Raises:
        ConfigError: one line naming the bad flag.
    """
    if args.ranks < 2:
        raise ConfigError(f"--ranks must be >= 2 (one of them slowed), got {args.ranks}")
    if args.batch < args.ranks:
        raise ConfigError(f"--batch must be >= --ranks ({args.ranks}), got {args.batch}")
    if args.slow_factor < 1.0:
        raise ConfigError(f"--slow-factor must be >= 1, got {args.slow_factor}")
    if args.warmup < 0 or min(args.mlp, args.repeats, args.monitor_every, args.monitor_slow_steps) < 1:
        raise ConfigError(
            "--warmup must be >= 0; --mlp, --repeats, --monitor-every, --monitor-slow-steps >= 1"
        )
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ConfigError(
            f"--scenarios: unknown {unknown or 'none given'}; choose from {','.join(SCENARIOS)}"
        )
    if epoch_rows(args) < 2 * args.ranks * args.batch * (args.warmup + 2):
        raise ConfigError(
            f"--rows {args.rows} gives too few steps for --warmup {args.warmup}: "
            f"use at least {2 * args.ranks * args.batch * (args.warmup + 2)}"
        )
    return [n for n in SCENARIOS if n in names]


def row_group_rows(args) -> int:
    """Rows per row group (a dynamic shard): two local batches."""
    return 2 * args.batch


def epoch_rows(args) -> int:
    """``--rows`` rounded down to whole shards for every rank: no batch is dropped and the
    dynamic shards split evenly, so an unmitigated epoch trains every row once."""
    unit = args.ranks * row_group_rows(args)
    return args.rows // unit * unit


# --------------------------------------------------------------------- data


def write_dataset(root: Path, rows: int, group_rows: int, seed: int) -> None:
    """Writes ``root/train`` (``rows`` rows) and ``root/test``: dense column 0 is the row id
    (``index / ROW_SCALE``), then 12 normal dense columns, 4 sparse fields, click labels."""
    from recaccel.io.format.schema import FeatureSchema, SparseField
    from recaccel.io.format.writer import write_parquet

    schema = FeatureSchema(
        dense=("row_id", *(f"d{i}" for i in range(1, DENSE))),
        sparse=tuple(SparseField(f"s{i}", VOCAB) for i in range(SPARSE)),
    )
    for split, n, split_seed in (("train", rows, seed), ("test", 4 * group_rows, seed + 1)):
        rng = np.random.default_rng(split_seed)
        cols: dict[str, Any] = {
            "label": (rng.random(n) < 0.25).astype(np.float32),
            "row_id": (np.arange(n) / ROW_SCALE).astype(np.float32),
        }
        cols.update({f"d{i}": rng.standard_normal(n).astype(np.float32) for i in range(1, DENSE)})
        cols.update({f.name: rng.integers(0, VOCAB, n) for f in schema.sparse})
        write_parquet(root / split, schema, cols, rows_per_row_group=group_rows)


def monitor_slow_factor(args) -> float:
    """``monitor.slow_factor``: halfway to ``--slow-factor`` (the slow rank's compute is
    ``--slow-factor`` x its peers', flagged well below that)."""
    return max(1.0 + (args.slow_factor - 1.0) / 2, 1.05)


def run_key(name: str, round_: int) -> str:
    """One run of a scenario: its files' and run directory's name."""
    return f"{name}-{round_}"


def scenario_overrides(args, name: str, root: Path, round_: int = 0) -> list[str]:
    """The config overrides of one scenario's run (the same model, data and monitor for all)."""
    straggler, data, slowed = SCENARIOS[name]
    w = args.mlp
    batch = args.batch * args.ranks if data == "global" else args.batch  # dynamic: per rank
    sets = [
        f'data.train="{root / "train"}"',
        f'data.test="{root / "test"}"',
        f"data.batch_size={batch}",
        f"data.shuffle_buffer_rows={4 * row_group_rows(args)}",
        f"data.seed={args.seed}",
        "data.shard_row_groups=1",
        "model.embedding_dim=16",
        f"model.bottom_mlp=[{w}, {w // 2}, 16]",
        f"model.top_mlp=[{w}, {w // 2}, 1]",
        "optim.sparse=rowwise_adagrad",
        "parallel.mode=hybrid",
        "parallel.sharding=table_wise",
        f"parallel.data={data}",
        f"parallel.straggler={straggler}",
        "parallel.timeout_s=120",
        f"monitor.every={args.monitor_every}",
        f"monitor.slow_steps={args.monitor_slow_steps}",
        f"monitor.slow_factor={monitor_slow_factor(args)}",
        "train.epochs=1",
        "train.device=cpu",
        "train.progress=false",
        "train.log_every=1000000",
        f"train.seed={args.seed}",
        f'train.out_dir="{root / "runs" / run_key(name, round_)}"',
    ]
    if slowed:
        sets += [f"fault.slow_rank={args.ranks - 1}", f"fault.slow_factor={args.slow_factor}"]
    return sets


# --------------------------------------------------------------- the ranks


class _Recorder:
    """A step observer's callback (``BatchCallback``) of one run on one rank: records each
    step's start time and the row ids of its local batch, one line per step."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, step: int, batch) -> None:
        import torch

        start = time.perf_counter()
        ids = torch.round(batch.dense[:, 0].double() * ROW_SCALE).long().tolist()
        self.lines.append(f"{start:.6f} " + " ".join(map(str, ids)))


def _rank_main(rank: int, world: int, port: int, root: str, plan: list[dict[str, Any]]) -> None:
    """One rank: joins the gloo group, trains every run of ``plan`` in turn, writing
    ``<key>.<rank>.steps`` (one line per step: start time, row ids). A run whose config is
    refused (on every rank alike) leaves ``<key>.refused``; any other failure
    ``error-<rank>.txt`` and exit 1.

    Each plan entry: ``key`` (the run's name) and ``sets`` (its config overrides).
    """
    import logging

    import torch
    import torch.distributed as dist

    from recaccel.config import load_config
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.loop.observers import BatchCallback
    from recaccel.train.loop.trainer import Trainer

    torch.set_num_threads(1)
    logging.getLogger("recaccel").setLevel(logging.ERROR)  # the monitor's flag warnings
    out = Path(root)
    try:
        join_local_gloo(rank, world, port, timeout_s=120)
        for run in plan:
            key = run["key"]
            start = time.perf_counter()
            try:
                cfg = load_config(None, run["sets"])
                parallel = HybridParallel(cfg, torch.device("cpu"))
                recorder = _Recorder()
                Trainer(cfg, parallel=parallel, observers=[BatchCallback(recorder)]).fit()
            except ConfigError as e:
                if rank == 0:
                    (out / f"{key}.refused").write_text(str(e).strip().splitlines()[0])
                dist.barrier()
                continue
            (out / f"{key}.{rank}.steps").write_text("\n".join(recorder.lines) + "\n")
            if rank == 0:
                (out / f"{key}.done").write_text(f"{time.perf_counter() - start:.1f}")
        dist.destroy_process_group()
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(
    args, root: Path, names: list[str], progress: Callable[[str], None]
) -> dict[str, list[dict[str, Any]]]:
    """Spawns the W ranks, waits for ``--repeats`` rounds of the scenarios.

    Returns:
        name -> per round ``{"steps": [rank][step] -> (time, ids), "metrics": metrics.json}``
        or ``{"refused": reason}``.

    Raises:
        RecaccelError: a rank failed (its error's last line) or the run timed out.
    """
    import torch.multiprocessing as mp

    keys = [
        (run_key(n, r), f"{n} (round {r + 1}/{args.repeats})") for r in range(args.repeats) for n in names
    ]
    plan = [
        {"key": run_key(n, r), "sets": scenario_overrides(args, n, root, r)}
        for r in range(args.repeats)
        for n in names
    ]
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, args.ranks, port, str(root), plan)) for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    deadline, reported = time.monotonic() + args.timeout, set()
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
            _report_progress(root, keys, reported, progress)
            if list(root.glob("error-*.txt")):
                break
    finally:
        for p in procs:
            p.join(1 if list(root.glob("error-*.txt")) else 5)
            if p.is_alive():
                p.kill()
                p.join()
    _report_progress(root, keys, reported, progress)
    errors = sorted(root.glob("error-*.txt"))
    if errors:
        last = errors[0].read_text().strip().splitlines()[-1]
        raise RecaccelError(f"straggler: {errors[0].stem.replace('error-', 'rank ')} failed: {last}")
    if any(p.exitcode != 0 for p in procs):
        raise RecaccelError(f"straggler: the ranks did not finish within --timeout {args.timeout:g} s")
    return {n: [_load_run(root, run_key(n, r), args.ranks) for r in range(args.repeats)] for n in names}


def _report_progress(
    root: Path, keys: list[tuple[str, str]], reported: set, progress: Callable[[str], None]
) -> None:
    for key, label in keys:
        if key in reported:
            continue
        if (root / f"{key}.done").exists():
            progress(f"straggler: {label} trained in {float((root / f'{key}.done').read_text()):.1f} s")
        elif (root / f"{key}.refused").exists():
            progress(f"straggler: {label} refused: {(root / f'{key}.refused').read_text()}")
        else:
            continue
        reported.add(key)


def _load_run(root: Path, key: str, ranks: int) -> dict[str, Any]:
    if (root / f"{key}.refused").exists():
        return {"refused": (root / f"{key}.refused").read_text()}
    steps = []
    for rank in range(ranks):
        lines = (root / f"{key}.{rank}.steps").read_text().splitlines()
        steps.append([(float(t), [int(i) for i in rest]) for t, *rest in (line.split() for line in lines)])
    metrics = json.loads((root / "runs" / key / "metrics.json").read_text())
    return {"steps": steps, "metrics": metrics}


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(args, command_line: str) -> Path:

    names = check_args(args)
    rows = epoch_rows(args)
    with tempfile.TemporaryDirectory(prefix="recaccel-straggler-") as tmp:
        root = Path(tmp)
        write_dataset(root, rows, row_group_rows(args), args.seed)
        runs = run_ranks(args, root, names, _stderr)
    result = analyse(args, runs, rows)
    env = environment_info("cpu")
    env["device"] = (
        f"{env['device'].split(' (')[0]} ({os.cpu_count()} cores, {args.ranks} gloo ranks, 1 thread each)"
    )
    setup = {
        "ranks": args.ranks,
        "rows": rows,
        "batch_per_rank": args.batch,
        "slow_rank": args.ranks - 1,
        "slow_factor": args.slow_factor,
        "warmup_steps": args.warmup,
        "repeats": args.repeats,
        "monitor_every": args.monitor_every,
        "monitor_slow_steps": args.monitor_slow_steps,
        "monitor_slow_factor": monitor_slow_factor(args),
        "mlp": args.mlp,
        "overrides": {n: scenario_overrides(args, n, Path("<tmp>")) for n in names},
    }
    plot = plot_file(args)
    if plot is not None:
        write_plot(plot, result, setup)
    summary = write_markdown(Path(args.out), env, command_line, setup, result, plot)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {**result, "environment": env, "command": command_line, "setup": setup}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return summary
