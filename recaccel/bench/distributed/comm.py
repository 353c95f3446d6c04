"""``recaccel-bench comm``: bytes a hybrid training step moves, measured vs the analytic model.

Two processes on gloo (CPU) run real hybrid DLRM steps (:class:`~recaccel.train.distributed.hybrid.HybridParallel`)
for each sharding kind, with every ``torch.distributed`` collective instrumented; the
bytes each rank *sends* per step are compared with :func:`analytic_bytes`, the cost
model of ``bench/results/cost_model.md`` evaluated on the sharding plan TorchRec chose.

Counting convention (per rank, per step, what leaves the rank): all-to-all = the input
splits addressed to other ranks; all-reduce = ``2 (W-1)/W`` of the buffer (ring);
reduce-scatter = ``(W-1)/W`` of the input; all-gather = ``(W-1)`` local chunks.

Inputs: F single-table features of R rows, dim D, every bag exactly L ids drawn
uniformly (so table-wise and column-wise volumes are exact and row-wise ones are
expectations), global batch B split over W = 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from recaccel.bench.distributed.local_group import free_port, join_local_gloo
from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, write_results_markdown
from recaccel.config import ShardingKind, choices
from recaccel.errors import ConfigError

WORLD = 2
KINDS = choices(ShardingKind)
_COLLECTIVES = (
    "all_reduce",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_gather",
)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tables", type=int, default=8, help="F features, one table each")
    parser.add_argument("--rows", type=int, default=10_000, help="R rows per table")
    parser.add_argument("--dim", type=int, default=64, help="D (a multiple of 4)")
    parser.add_argument("--batch", type=int, default=1024, help="global batch B (split over 2 ranks)")
    parser.add_argument("--pooling", type=int, default=4, help="L ids per bag")
    parser.add_argument("--dense", type=int, default=13, help="dense features")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per sharding (after 2 warm-up)")
    parser.add_argument("--shardings", default=",".join(KINDS), help="comma-separated kinds")
    add_output_args(parser, "comm")
    parser.add_argument("--json", help="also write the raw numbers here")


def _sent_bytes(name: str, args: tuple, kwargs: dict, rank: int, world: int) -> tuple[str, float]:
    """What one call sends from this rank, by the module's counting convention."""

    def arg(i: int, key: str):
        return args[i] if len(args) > i else kwargs.get(key)

    if name == "all_reduce":
        t = arg(0, "tensor")
        return "all_reduce", 2 * (world - 1) / world * t.numel() * t.element_size()
    if name == "all_to_all_single":
        inp, splits = arg(1, "input"), arg(3, "input_split_sizes")
        per_row = inp.element_size() * (inp[0].numel() if inp.dim() and inp.shape[0] else 1)
        rows = list(splits) if splits else [inp.shape[0] // world] * world if inp.dim() else [0] * world
        return "all_to_all", sum(n for r, n in enumerate(rows) if r != rank) * per_row
    if name == "reduce_scatter_tensor":
        t = arg(1, "input")
        return "reduce_scatter", (world - 1) / world * t.numel() * t.element_size()
    if name == "all_gather_into_tensor":
        t = arg(1, "input_tensor")
        return "all_gather", (world - 1) * t.numel() * t.element_size()
    t = arg(1, "tensor")  # all_gather(list, tensor)
    return "all_gather", (world - 1) * t.numel() * t.element_size()


def _batch(args: argparse.Namespace, gen: torch.Generator):
    from recaccel.sparse import Batch, SparseFeatures

    b, f, n = args.batch, args.tables, args.batch * args.tables * args.pooling
    lengths = torch.full((f * b,), args.pooling, dtype=torch.int64)
    values = torch.randint(0, args.rows, (n,), generator=gen)
    keys = [f"t{i}" for i in range(f)]
    labels = torch.randint(0, 2, (b,), generator=gen).float()
    sparse = SparseFeatures.from_lengths(keys, values, lengths)
    return Batch(torch.randn(b, args.dense, generator=gen), sparse, labels)


def _run_kind(rank: int, args: argparse.Namespace, kind: str) -> dict:
    import torch.distributed as dist

    from recaccel.config import load_config
    from recaccel.io.format.schema import FeatureSchema, SparseField
    from recaccel.models.factory import build_model
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.distributed.hybrid_data import GlobalSlices
    from recaccel.train.distributed.sharding import plan_rows
    from recaccel.train.model.objectives import DLRMObjective
    from recaccel.train.model.optim import build_dense_optimizer

    cfg = load_config(
        None,
        [
            "parallel.mode=hybrid",
            f"parallel.sharding={kind}",
            f"model.embedding_dim={args.dim}",
            f"model.bottom_mlp=[64, {args.dim}]",
            "model.top_mlp=[64, 1]",
            "optim.sparse=rowwise_adagrad",
            "model.embedding_backend=reference",
        ],
    )
    schema = FeatureSchema(
        dense=tuple(f"d{i}" for i in range(args.dense)),
        sparse=tuple(SparseField(f"t{i}", args.rows, multi_hot=args.pooling > 1) for i in range(args.tables)),
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.optim, schema, torch.device("cpu"))
    objective = DLRMObjective(cfg, model, "bce")
    parallel = HybridParallel(cfg, torch.device("cpu"))
    parallel.wrap(objective.module)
    optimizer = build_dense_optimizer(objective.module, cfg.optim)
    slicer = GlobalSlices(None, rank, WORLD, train=True)
    gen = torch.Generator().manual_seed(1)
    batches = [slicer.local(_batch(args, gen)) for _ in range(args.steps + 2)]
    sent: dict[str, float] = defaultdict(float)
    originals = {n: getattr(dist, n) for n in _COLLECTIVES}
    counting = [False]

    def wrap(name):
        def call(*a, **kw):
            if counting[0]:
                kind_, nbytes = _sent_bytes(name, a, kw, rank, WORLD)
                sent[kind_] += nbytes
            return originals[name](*a, **kw)

        return call

    times = []
    for n in _COLLECTIVES:
        setattr(dist, n, wrap(n))
    try:
        for i, local in enumerate(parallel.batches(batches, objective)):
            counting[0] = i >= 2
            start = time.perf_counter()
            parallel.train_step(objective, optimizer, local)
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        for n in _COLLECTIVES:
            setattr(dist, n, originals[n])
    dense = sum(p.numel() for p in parallel.dense_parameters(optimizer))
    plan = plan_rows(parallel.plan) if parallel.plan is not None else []
    # Counted: steps 2.. and the agreement before each (the first counted agreement is the one
    # ending the data, so every counted step has exactly one).
    return {
        "sent": {k: v / args.steps for k, v in sent.items()},
        "ms": sorted(times)[len(times) // 2],
        "plan": plan,
        "dense_params": dense,
    }


def _worker(rank: int, port: int, args: argparse.Namespace, kinds: list[str], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    join_local_gloo(rank, WORLD, port, timeout_s=300)
    results = {kind: _run_kind(rank, args, kind) for kind in kinds}
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    from recaccel.train.distributed.launch import exit_rank

    exit_rank(0)  # results are written; skip the teardown that can abort after gloo


def analytic_bytes(
    plan: list[dict], rank: int, world: int, batch: int, pooling: int, dim: int, dense_params: int
) -> dict[str, float]:
    """The cost model: bytes rank ``rank`` sends per hybrid step (see cost_model.md).

    Args:
        plan: :func:`~recaccel.train.distributed.sharding.plan_rows` rows (one feature per table).
        rank, world: this rank and W.
        batch: global batch B (local b = B / W).
        pooling: ids per bag L (uniform ids).
        dim: D.
        dense_params: replicated parameters in the gradient bucket (data-parallel tables included).

    Returns:
        Bytes by collective kind: ``all_to_all``, ``reduce_scatter``, ``all_gather``, ``all_reduce``.
    """
    b = batch // world
    ring = (world - 1) / world
    out = {
        "all_to_all": 0.0,
        "reduce_scatter": 0.0,
        "all_gather": 0.0,
        # the dense bucket + the loss (fp32), and the agreement: 5 + 2W float64 (timings per rank)
        "all_reduce": 2 * ring * ((dense_params + 1) * 4 + (5 + 2 * world) * 8),
    }
    ids = b * (pooling * 8 + 8)  # int64 ids and one int64 length per bag
    for row in plan:
        if row["sharding"] == "row_wise":
            out["all_to_all"] += b * pooling * 8 * ring + (world - 1) * b * 8  # bucketized ids, all lengths
            out["reduce_scatter"] += ring * batch * dim * 4  # partial pools, forward
            out["all_gather"] += ring * batch * dim * 4  # their gradients, backward
            continue
        for shard_ranks, size in zip(row["ranks"], row["shards"]):
            width = size[1]
            if shard_ranks != rank:
                out["all_to_all"] += ids + b * width * 4  # ids out, pooled gradients out
            else:
                out["all_to_all"] += (world - 1) * b * width * 4  # pooled rows to every other rank
    return out


def main(args: argparse.Namespace, command_line: str) -> Path:
    """Runs the measurement on 2 gloo processes; writes ``args.out`` (markdown) and returns it."""
    try:
        import torchrec  # noqa: F401
    except ImportError:
        raise ConfigError("recaccel-bench comm needs torchrec (pip install torchrec fbgemm-gpu)") from None
    kinds = [k.strip() for k in args.shardings.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or args.dim % 4 or args.batch % WORLD:
        raise ConfigError(
            f"--shardings must be among {KINDS} (got {bad}); --dim a multiple of 4; --batch even"
        )
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, port, args, kinds, tmp)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise ConfigError(f"comm benchmark workers failed (exit codes {[p.exitcode for p in procs]})")
        measured = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    rows = _report_rows(args, kinds, measured)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "measured": measured}, indent=2))
    notes = [
        "KB *sent* by each rank per training step (one row per rank), measured by instrumenting "
        "torch.distributed during real hybrid steps, next to analytic_bytes() (the cost model) on the plan "
        "TorchRec chose; total_ratio = measured / model. all_reduce = the dense-gradient bucket + the "
        "step agreement (5 + 2W float64: has a batch, normaliser, rows, each rank's timing and rows, the stop signals).",
        "all_to_all includes TorchRec's small split/length-metadata exchanges, which the model ignores; "
        "row_wise volumes are expectations over uniform ids.",
        f"Model: {args.tables} tables x {args.rows} rows, D={args.dim}, L={args.pooling}, B={args.batch} "
        f"(b={args.batch // WORLD} per rank), {args.dense} dense features, MLPs [64, D] / [64, 1].",
        "ms = median step time on gloo over loopback TCP on this CPU host: a functional figure, "
        "not a GPU projection (see cost_model.md).",
    ]
    env = environment_info("cpu")
    return write_results_markdown(
        args.out, "Hybrid step communication: measured vs analytic", env, command_line, rows, notes
    )


def _report_rows(args: argparse.Namespace, kinds: list[str], measured: list[dict]) -> list[dict]:
    rows = []
    for kind in kinds:
        for rank in range(WORLD):
            got = measured[rank][kind]
            model = analytic_bytes(
                got["plan"], rank, WORLD, args.batch, args.pooling, args.dim, got["dense_params"]
            )
            row = {"sharding": kind, "rank": rank}
            for key in ("all_to_all", "reduce_scatter", "all_gather", "all_reduce"):
                row[f"{key}_KB"] = got["sent"].get(key, 0.0) / 1e3
                row[f"{key}_model_KB"] = model[key] / 1e3
            total, total_model = sum(got["sent"].values()), sum(model.values())
            row["total_ratio"] = total / total_model if total_model else None
            row["ms"] = got["ms"]
            rows.append(row)
    return rows


if __name__ == "__main__":  # pragma: no cover
    import sys

    # ``recaccel-bench comm`` once registered in recaccel.bench.harness.registry; runnable directly meanwhile.
    _parser = argparse.ArgumentParser(prog="python -m recaccel.bench.distributed.comm")
    add_args(_parser)
    main(_parser.parse_args(), "python -m recaccel.bench.distributed.comm " + " ".join(sys.argv[1:]))
