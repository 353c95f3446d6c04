"""Benchmark: training throughput with host-placed tables behind the lookahead cache.

``recaccel-bench cache_train`` trains one DLRM three ways in one run, on the same batches
(Zipf ids over every table, kept on the device: no input cost), through the trainer's own
loop (:meth:`~recaccel.train.loop.parallel.SingleProcess.steps`: the batch pipeline prepares
``cache_lookahead - 1`` batches ahead, which makes their rows resident):

- ``device``: every table on the device (the ceiling);
- ``host``: tables in host memory, a device cache of ``--cache-fraction`` of their rows;
- ``host_min``: the same with the smallest cache the window allows (the unique rows of
  the window's batches): nearly every row is fetched for its batch and written back,
  the cost of a host table without a cache worth the name.

Blocks of ``--block`` consecutive steps are timed, interleaved across the three (CUDA
events on a GPU), median reported. The three must train alike: their losses are compared
at the end (bit-identical on CPU, float tolerance on CUDA), so the timing cannot come from
a different computation. The GPU target (issue 14): ``host`` at 10% cached >= 60% of
``device`` samples/s on Zipf 1.05.

Shapes: B batch, T tables (one field each), R rows per table, D dim.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, write_results_markdown
from recaccel.bench.harness.timing import time_interleaved_samples
from recaccel.config import Config, ModelConfig, OptimConfig, TrainConfig
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.models.factory import build_model
from recaccel.sparse import Batch, SparseFeatures
from recaccel.train.loop.parallel import SingleProcess
from recaccel.train.model.objectives import DLRMObjective
from recaccel.train.model.optim import build_dense_optimizer

TARGET = 0.6  # host at 10% cached: this share of the device placement's samples/s (GPU)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--tables", type=int, help="T tables (default: 8 on CUDA, 4 on CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--rows", type=int, help="R rows per table (default: 1,000,000 on CUDA, 20,000 on CPU)"
    )
    parser.add_argument("--dim", type=int, help="D (default: 64 on CUDA, 16 on CPU)")
    parser.add_argument("--batch", type=int, help="B (default: 16,384 on CUDA, 256 on CPU)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--cache-fraction", type=float, default=0.1, help="the host candidate's cache share")
    parser.add_argument("--lookahead", type=int, default=2, help="model.cache_lookahead")
    parser.add_argument("--batches", type=int, default=16, help="distinct batches, rotated")
    parser.add_argument("--block", type=int, default=4, help="consecutive steps per timed sample")
    parser.add_argument("--repeats", type=int, default=10, help="timed blocks per candidate")
    parser.add_argument("--warmup", type=int, default=2, help="untimed blocks per candidate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model")
    parser.add_argument("--json", help="also write the results as JSON here")
    add_output_args(parser, "cache_train")


def zipf_ids(rng: np.random.Generator, rows: int, count: int, exponent: float) -> np.ndarray:
    """``count`` ids in ``[0, rows)``, rank r drawn with probability ~ r^-exponent, ranks
    scattered over the table (a fixed random permutation) so hot rows are not adjacent."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(count) * cdf[-1])
    return np.random.default_rng(12345).permutation(rows)[np.minimum(ranks, rows - 1)]


def make_batches(args, rng: np.random.Generator, device: torch.device) -> list[Batch]:
    """``--batches`` one-hot batches of T fields with Zipf ids, 13 dense features, click labels."""
    names = [f"t{t}" for t in range(args.tables)]
    out = []
    for _ in range(args.batches):
        values = np.concatenate([zipf_ids(rng, args.rows, args.batch, args.zipf) for _ in names])
        sparse = SparseFeatures.from_lengths(
            names, torch.from_numpy(values), torch.ones(args.tables * args.batch, dtype=torch.int64)
        )
        dense = torch.from_numpy(rng.standard_normal((args.batch, 13), dtype=np.float32))
        labels = torch.from_numpy((rng.random(args.batch) < 0.25).astype(np.float32))
        out.append(Batch(dense, sparse, labels).to(device))
    return out


def window_unique_rows(batches: list[Batch], window: int) -> int:
    """The most unique rows (over all tables, as one pack) that ``window`` consecutive
    batches of the rotation look up together: the smallest feasible cache."""
    rows_of = []
    for b in batches:
        sf = b.sparse
        per_table = sf.batch_size
        table = torch.arange(len(sf.keys), device=sf.values.device).repeat_interleave(per_table)
        rows_of.append(set((table * 10**9 + sf.values).tolist()))
    most = 0
    for i in range(len(batches)):
        union = set().union(*(rows_of[(i + j) % len(batches)] for j in range(window)))
        most = max(most, len(union))
    return most


def build_run(
    cfg: Config, schema: FeatureSchema, device: torch.device
) -> tuple[DLRMObjective, torch.optim.Optimizer]:
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.optim, schema, device)
    objective = DLRMObjective(cfg, model, "bce")
    return objective, build_dense_optimizer(model, cfg.optim)


def candidate_configs(args, min_rows: int) -> dict[str, Config]:
    """The three placements' configs (one seed: the same initial rows and MLPs)."""
    base = dict(
        embedding_dim=args.dim,
        bottom_mlp=[64, args.dim],
        top_mlp=[128, 64, 1],
        embedding_backend="auto",
        cache_lookahead=args.lookahead,
    )
    models = {
        "device": ModelConfig(**base),
        "host": ModelConfig(**base, embedding_placement="host", cache_fraction=args.cache_fraction),
        "host_min": ModelConfig(**base, embedding_placement="host", cache_rows=min_rows),
    }
    optim = OptimConfig(dense="adam", lr=1e-3, sparse="rowwise_adagrad", sparse_lr=0.05)
    return {
        name: Config(model=m, optim=optim, train=TrainConfig(seed=args.seed, pipeline="sync", progress=False))
        for name, m in models.items()
    }


def _stepper(objective, optimizer, cfg: Config, batches: list[Batch], device, block: int, losses: list):
    def source() -> Iterator[tuple[Batch, dict]]:
        i = 0
        while True:
            yield batches[i % len(batches)], {}
            i += 1

    steps = SingleProcess(device).steps(source(), objective, optimizer, cfg.train)

    def run() -> None:
        for _ in range(block):
            losses.append(next(steps).loss)

    return run


def run_bench(args) -> dict:
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    # The GPU size finishes in well under a minute (8 x 1M x 64 rows: 2 GB per placement,
    # drawn on the host three times); 26 x 2M x 128 took minutes before the first step.
    for key, gpu, cpu in (
        ("tables", 8, 4),
        ("rows", 1_000_000, 20_000),
        ("dim", 64, 16),
        ("batch", 16_384, 256),
    ):
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    blocks = 3 * (args.repeats + args.warmup)
    bar = tqdm(total=3 + blocks, desc="cache_train: drawing batches", unit="step", file=sys.stderr,
               disable=getattr(args, "no_progress", False), dynamic_ncols=True)  # fmt: skip
    rng = np.random.default_rng(args.seed)
    batches = make_batches(args, rng, device)
    fields = tuple(SparseField(f"t{t}", args.rows) for t in range(args.tables))
    schema = FeatureSchema(tuple(f"d{i}" for i in range(13)), fields)
    min_rows = window_unique_rows(batches, args.lookahead + 1)
    configs = candidate_configs(args, min_rows)
    losses: dict[str, list] = {name: [] for name in configs}
    runs: dict[str, Callable[[], None]] = {}
    objectives = {}
    for name, cfg in configs.items():
        bar.set_description(f"cache_train: building {name}")
        bar.update()
        objective, optimizer = build_run(cfg, schema, device)
        objectives[name] = objective
        run = _stepper(objective, optimizer, cfg, batches, device, args.block, losses[name])
        runs[name] = lambda run=run: (run(), bar.update())
    bar.set_description(f"cache_train: timing {blocks} blocks of {args.block} steps")
    samples = time_interleaved_samples(runs, args.repeats, args.warmup, device)
    bar.close()
    check_same_training(losses, cuda)
    rows = []
    for name, times in samples.items():
        ms = statistics.median(times) / args.block
        stats = objectives[name].module.sparse_arch.embedding.cache_stats()
        steps = (args.repeats + args.warmup) * args.block
        rows.append(
            {
                "candidate": name,
                "step_ms": ms,
                "samples_per_s": args.batch / (ms / 1000),
                "cache_rows": int(stats.get("cache_rows", 0)),
                "cache_hit_rate": stats.get("cache_hit_rate"),
                "h2d_mb_per_step": stats.get("cache_bytes_h2d", 0.0) / steps / 2**20,
                "d2h_mb_per_step": stats.get("cache_bytes_d2h", 0.0) / steps / 2**20,
            }
        )
    device_rate = next(r["samples_per_s"] for r in rows if r["candidate"] == "device")
    for r in rows:
        r["vs_device"] = r["samples_per_s"] / device_rate
    return {"device": str(device), "rows": rows, "min_cache_rows": min_rows}


def check_same_training(losses: dict[str, list], cuda: bool) -> None:
    """The placements' step losses agree (bit for bit on CPU), else the timing is void.

    Raises:
        ConfigError: one line naming the candidate and the largest difference.
    """
    ref = torch.stack([t.float() for t in losses["device"]]).cpu()
    for name, values in losses.items():
        got = torch.stack([t.float() for t in values]).cpu()
        diff = float((got - ref).abs().max()) if got.numel() else 0.0
        if (not cuda and diff != 0.0) or (cuda and diff > 1e-3):
            raise ConfigError(
                f"cache_train: {name} trained differently from device placement (max loss diff {diff})"
            )


def main(args, command_line: str) -> Path:
    if not 0.0 < args.cache_fraction <= 1.0:
        raise ConfigError(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    result = run_bench(args)
    env = environment_info(result["device"])
    host = next(r for r in result["rows"] if r["candidate"] == "host")
    verdict = "met" if host["vs_device"] >= TARGET else "not met"
    notes = [
        f"T={args.tables} tables x R={args.rows} rows, D={args.dim}, B={args.batch}, Zipf {args.zipf}, "
        f"cache_lookahead={args.lookahead}, train.pipeline=sync; {args.batches} batches rotated on the device.",
        f"host: {args.cache_fraction:.0%} of the rows cached; host_min: {result['min_cache_rows']} rows, the "
        "unique rows of the window's batches (nearly every row fetched per batch).",
        f"Target (GPU): host >= {TARGET:.0%} of device samples/s: {host['vs_device']:.2f}, {verdict}"
        + ("" if result["device"].startswith("cuda") else " (CPU: the target is a GPU figure)")
        + ".",
        "The three trained alike (losses compared; bit-identical on CPU).",
    ]
    out = Path(args.out)
    summary = write_results_markdown(
        out, "Training throughput with host-placed tables", env, command_line, result["rows"], notes=notes
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"environment": env, "command": command_line, **result}, indent=2)
        )
    return summary
