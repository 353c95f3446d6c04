"""Benchmark: the batched (and torch.func vmapped) meta step vs a per-task Python loop.

Every candidate does one whole meta step, forward and backward of the outer loss, on
the same TaskBatch and model (DLRM with fused packed embeddings by default): one
embedding lookup for all support and query rows, the shared dense arch and
interaction, the inner loop, the query loss and its backward (the fused sparse update
included). Only the inner/outer loop engine differs (:mod:`recaccel.meta.maml`):

- ``batched``: per-task parameters stacked on a task axis, batched matmuls;
- ``vmap``: ``torch.func.vmap`` of ``torch.func.grad`` through the model's modules;
- ``loop``: a Python loop over tasks with ``torch.autograd.grad`` (the baseline).

Candidates are timed interleaved (median; :func:`recaccel.bench.harness.timing.time_interleaved`).
Memory, in bytes allocated above what was held before the step: ``peak`` (the most at
any time in forward and backward) and ``graph`` (held when the forward returns: the
saved autograd graph). On CUDA from the caching allocator's counters
(``memory_allocated``, ``max_memory_allocated``); on CPU, which keeps no allocator
statistics, from the allocation and free events of ``torch.profiler`` with
``profile_memory=True``, summed in time order (requested sizes, not resident pages).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, write_results_markdown
from recaccel.bench.harness.timing import time_interleaved
from recaccel.bench.kernels.agreement import max_relative_error
from recaccel.config import MetaConfig
from recaccel.errors import RecaccelError
from recaccel.meta import MetaLearner
from recaccel.meta.synthetic import SyntheticTasks
from recaccel.models.arches import DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.sparse import TaskBatch

log = logging.getLogger(__name__)

ORDERS = {"first": True, "second": False}
# Engine vs loop (float32, same math, other summation order): outer loss, outer gradients.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@dataclass
class MetaBenchSpec:
    """One benchmark setting (everything a fresh process needs to rebuild it)."""

    tasks: int = 32
    support: int = 32
    query: int = 32
    num_fields: int = 8
    num_dense: int = 13
    embedding_dim: int = 16
    cardinality: int = 1000
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 32, 1])
    embedding: str = "packed"  # packed (fused sparse update) | per_table
    adapt: str = "top_mlp"
    inner_steps: int = 1
    inner_lr: float = 0.01
    device: str = "cpu"
    seed: int = 0


def build(spec: MetaBenchSpec) -> tuple[DLRM, TaskBatch]:
    """The model and the TaskBatch of a setting, on ``spec.device``."""
    device = torch.device(spec.device)
    world = SyntheticTasks(spec.num_dense, [spec.cardinality] * spec.num_fields, loss="bce", seed=spec.seed)
    tb = world.sample(
        spec.tasks, spec.support, spec.query, generator=torch.Generator().manual_seed(spec.seed)
    )
    torch.manual_seed(spec.seed)
    if spec.embedding == "packed":
        from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec

        tables = [TableSpec(k, spec.cardinality, spec.embedding_dim) for k in world.keys]
        emb = PackedEmbeddingBag(
            tables, mode="fused", optim=SparseOptimConfig(lr=0.01), device=device, seed=spec.seed
        )
    elif spec.embedding == "per_table":
        from recaccel.models.embedding import PerTableEmbeddingBag

        emb = PerTableEmbeddingBag(world.keys, [spec.cardinality] * spec.num_fields, spec.embedding_dim)
    else:
        raise ValueError(f"embedding must be 'packed' or 'per_table', got {spec.embedding!r}")
    inter = InteractionArch(spec.num_fields, spec.embedding_dim)
    model = DLRM(
        SparseArch(emb),
        DenseArch(spec.num_dense, spec.bottom_mlp),
        inter,
        OverArch(inter.output_dim, spec.top_mlp),
    ).to(device)
    return model, tb.to(device)


def _learner(model: DLRM, spec: MetaBenchSpec, engine: str, order: str) -> MetaLearner:
    cfg = MetaConfig(
        inner_steps=spec.inner_steps, inner_lr=spec.inner_lr, first_order=ORDERS[order], adapt=spec.adapt
    )
    return MetaLearner(model, cfg, loss="bce", engine=engine)


def _step(learner: MetaLearner, tb: TaskBatch) -> None:
    loss, _ = learner.step_loss(tb)
    loss.backward()
    learner.zero_grad(set_to_none=True)


def _memory(spec: MetaBenchSpec, learner: MetaLearner, tb: TaskBatch) -> tuple[int, int]:
    """(peak, graph) bytes of one meta step above what was allocated before it.

    ``graph``: held when the forward returns (the saved autograd graph); ``peak``: the
    most held at any time of forward and backward.
    """
    _step(learner, tb)  # warm: lazy state, caches
    if spec.device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss, _ = learner.step_loss(tb)
        torch.cuda.synchronize()
        graph = torch.cuda.memory_allocated() - base
        loss.backward()
        learner.zero_grad(set_to_none=True)
        del loss
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, graph
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("meta_bench_forward"):
            loss, _ = learner.step_loss(tb)
        loss.backward()
        learner.zero_grad(set_to_none=True)
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "meta_bench_forward")
    forward_end = mark.start_ns() + mark.duration_ns()
    memory = sorted(
        (e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU),
        key=lambda e: e.start_ns(),
    )
    held = peak = 0
    graph = None
    for e in memory:  # allocations are positive, frees negative
        if graph is None and e.start_ns() > forward_end:
            graph = held
        held += e.nbytes()
        peak = max(peak, held)
    return peak, held if graph is None else graph


def run_meta_bench(
    tasks: int = 32,
    support: int = 32,
    query: int = 32,
    repeats: int = 30,
    device: torch.device | str = "cpu",
    json_path: str | Path | None = None,
    *,
    engines: Sequence[str] = ("batched", "vmap", "loop"),
    orders: Sequence[str] = ("first", "second"),
    warmup: int = 3,
    memory: bool = True,
    spec: MetaBenchSpec | None = None,
) -> list[dict]:
    """Times meta-step engines against the per-task loop.

    Args:
        tasks: T.
        support: S rows per task.
        query: Q rows per task.
        repeats: timed steps per candidate (median reported).
        device: where to run.
        json_path: if given, writes ``{"env": ..., "spec": ..., "results": [...]}`` there.
        engines: among ``batched``, ``vmap``, ``loop`` (the speedup needs ``loop``).
        orders: among ``first``, ``second``.
        warmup: untimed steps per candidate first.
        memory: also measure memory (see the module doc for how).
        spec: model and data shape; ``tasks``, ``support``, ``query``, ``device`` override it.

    Returns:
        One dict per (engine, order): ``ms`` (median), ``tasks_per_s``, ``speedup_vs_loop``
        (same order), ``second_over_first`` (same engine), ``peak_MiB`` and ``graph_MiB``,
        ``loss_diff_vs_loop`` and ``grad_diff_vs_loop`` (see :func:`check_engines_agree`).

    Raises:
        RecaccelError: an engine disagrees with the loop of its order (before anything is timed).
    """
    spec = MetaBenchSpec(
        **{
            **asdict(spec or MetaBenchSpec()),
            "tasks": tasks,
            "support": support,
            "query": query,
            "device": str(torch.device(device)),
        }
    )
    model, tb = build(spec)
    learners = {(e, o): _learner(model, spec, e, o) for e in engines for o in orders}
    diffs = check_engines_agree(model, learners, tb)
    ms = time_interleaved(
        {f"{e}/{o}": (lambda lr=learner: _step(lr, tb)) for (e, o), learner in learners.items()},
        repeats,
        warmup,
        spec.device,
    )
    rows = []
    for (e, o), learner in learners.items():
        row = _row(spec, e, o, ms, diffs)
        if memory:
            peak, graph = _memory(spec, learner, tb)
            row["peak_MiB"], row["graph_MiB"] = peak / 2**20, graph / 2**20
        rows.append(row)
        log.info("meta bench %s", row)
    if json_path is not None:
        _write_json(json_path, spec, rows)
    return rows


def _dense_params(model: DLRM) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("sparse_arch.")]


def _outer(model: DLRM, learner: MetaLearner, tb: TaskBatch) -> tuple[float, list[Tensor]]:
    """The outer loss and its gradients w.r.t. the dense parameters, in eval mode: the packed
    embedding's fused update (which would move the rows) is not on the path to them."""
    params = _dense_params(model)
    model.eval()
    try:
        loss = learner.step_loss(tb)[0]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        model.train()
    return float(loss.detach()), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def check_engines_agree(
    model: DLRM, learners: dict[tuple[str, str], MetaLearner], tb: TaskBatch
) -> dict[tuple[str, str], tuple[float, float]]:
    """Every engine's outer loss and outer gradients against the loop's of the same order
    (first and second order share the loss: only the gradients tell them apart).

    Returns:
        (engine, order) -> (|loss - loop's|, max |grad - loop's| / max |loop's| over the
        dense parameters), where the loop of that order runs.

    Raises:
        RecaccelError: beyond :data:`LOSS_RTOL` (times max(1, |loss|)) or :data:`GRAD_RTOL`.
    """
    outer = {key: _outer(model, learner, tb) for key, learner in learners.items()}
    diffs = {}
    for (e, o), (loss, grads) in outer.items():
        if ("loop", o) not in outer:
            continue
        ref_loss, ref_grads = outer["loop", o]
        loss_diff = abs(loss - ref_loss)
        grad_diff = max(
            (max_relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)), default=0.0
        )
        if not (loss_diff <= LOSS_RTOL * max(1.0, abs(ref_loss)) and grad_diff <= GRAD_RTOL):
            raise RecaccelError(
                f"meta bench: engine {e!r} ({o} order) disagrees with the per-task loop: outer loss by "
                f"{loss_diff:.3g} (bound {LOSS_RTOL:g} x max(1, |loss|)), outer gradients by {grad_diff:.3g} "
                f"of their largest value (bound {GRAD_RTOL:g}); nothing is timed"
            )
        diffs[e, o] = (loss_diff, grad_diff)
    return diffs


def _row(spec: MetaBenchSpec, e: str, o: str, ms: dict[str, float], diffs: dict) -> dict:
    """One (engine, order)'s figures, against the loop of the same order and its own first order."""
    t = ms[f"{e}/{o}"]
    row = {
        "engine": e,
        "order": o,
        "T": spec.tasks,
        "S": spec.support,
        "Q": spec.query,
        "ms": t,
        "tasks_per_s": spec.tasks / (t * 1e-3),
    }
    if (e, o) in diffs:
        row["speedup_vs_loop"] = ms[f"loop/{o}"] / t
        row["loss_diff_vs_loop"], row["grad_diff_vs_loop"] = diffs[(e, o)]
    if o == "second" and f"{e}/first" in ms:
        row["second_over_first"] = t / ms[f"{e}/first"]
    return row


def _write_json(json_path: str | Path, spec: MetaBenchSpec, rows: list[dict]) -> None:
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    payload = {"env": environment_info(spec.device), "spec": asdict(spec), "results": rows}
    Path(json_path).write_text(json.dumps(payload, indent=2))


def add_args(parser) -> None:
    """Options of ``recaccel-bench meta``."""
    d = MetaBenchSpec()
    parser.add_argument("--tasks", type=int, default=d.tasks, help="T tasks per meta batch")
    parser.add_argument("--support", type=int, default=d.support, help="S support rows per task")
    parser.add_argument("--query", type=int, default=d.query, help="Q query rows per task")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per candidate (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per candidate")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if present)",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    parser.add_argument("--engines", default="batched,vmap,loop", help="meta engines timed, comma-separated")
    parser.add_argument("--orders", default="first,second", help="MAML orders timed, comma-separated")
    parser.add_argument(
        "--adapt",
        default=d.adapt,
        choices=("top_mlp", "head", "head_and_embedding_shift"),
        help="the parameters the inner loop adapts (as meta.adapt)",
    )
    parser.add_argument("--inner-steps", type=int, default=d.inner_steps, help="inner-loop steps per task")
    parser.add_argument("--fields", type=int, default=d.num_fields, help="F sparse fields")
    parser.add_argument("--dense", type=int, default=d.num_dense, help="dense features per row")
    parser.add_argument("--dim", type=int, default=d.embedding_dim, help="D embedding dim")
    parser.add_argument("--cardinality", type=int, default=d.cardinality, help="rows per table")
    parser.add_argument(
        "--embedding",
        default=d.embedding,
        choices=("packed", "per_table"),
        help="one packed table or one table per field",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    parser.add_argument("--json", default=None, help="also write results as JSON here")
    add_output_args(parser, "meta")


def main(args, command_line: str) -> Path:
    """Runs the benchmark from parsed ``args``, writes the markdown report, returns its path."""
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = MetaBenchSpec(
        num_fields=args.fields,
        num_dense=args.dense,
        embedding_dim=args.dim,
        cardinality=args.cardinality,
        bottom_mlp=[64, args.dim],
        embedding=args.embedding,
        adapt=args.adapt,
        inner_steps=args.inner_steps,
    )
    rows = run_meta_bench(
        args.tasks,
        args.support,
        args.query,
        args.repeats,
        args.device,
        args.json,
        engines=args.engines.split(","),
        orders=args.orders.split(","),
        warmup=args.warmup,
        memory=not args.no_memory,
        spec=spec,
    )
    notes = [
        (
            "One candidate = one whole meta step (embedding lookup of all rows, shared dense arch and "
            "interaction, inner loop, query loss, backward with the fused sparse update); only the "
            "engine differs."
        ),
        (
            "batched = stacked per-task parameters + batched matmuls; vmap = torch.func.vmap(grad) over "
            "the model's modules; loop = Python loop over tasks with torch.autograd.grad."
        ),
        "Timed interleaved (order rotating each repeat), median ms; tasks_per_s = T / median.",
        (
            "peak_MiB / graph_MiB: bytes allocated above those held before the step, at the step's peak / "
            "when the forward returns (the saved graph). CUDA: memory_allocated counters; CPU: "
            "torch.profiler allocation events (profile_memory=True) summed in time order."
        ),
        "loss_diff_vs_loop: |outer loss - loop's outer loss| on the same batch (same math); "
        "grad_diff_vs_loop: max |outer gradient - loop's| / max |loop's| over the dense parameters. "
        f"Checked before timing (bounds {LOSS_RTOL:g} x max(1, |loss|) and {GRAD_RTOL:g}).",
        (
            f"Model: DLRM, {spec.num_fields} fields x {spec.cardinality} rows, D={spec.embedding_dim}, "
            f"{spec.num_dense} dense, bottom {spec.bottom_mlp}, top {spec.top_mlp}, {spec.embedding} "
            f"embedding; adapt={spec.adapt}, inner_steps={spec.inner_steps}, "
            f"threads={torch.get_num_threads()}."
        ),
    ]
    return write_results_markdown(
        args.out,
        "Meta step: batched / vmapped vs per-task loop",
        environment_info(args.device),
        command_line,
        rows,
        notes,
    )
