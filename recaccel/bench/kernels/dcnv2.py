"""Benchmark of the DCN-v2 cross network: the GEMM path and the one-launch kernel against eager.

``recaccel-bench interaction --kind dcnv2`` runs it. Per shape (B, F, D; K = D*(F+1)
features, ``--layers`` layers of ``--rank``) three implementations are timed interleaved,
forward alone and forward + backward (w.r.t. x0 and every weight):

- ``eager``: per layer matmul, addmm, multiply, add (``dcnv2_cross_reference``);
- ``gemm``: library GEMMs + one fused elementwise kernel per layer (``model.dcn_kernel = "gemm"``,
  :mod:`recaccel.ops.interaction.dcnv2_gemm`), the default on CUDA;
- ``fused``: all layers in one launch (``model.dcn_kernel = "fused"``,
  :mod:`recaccel.ops.interaction.dcnv2_triton`).

Each row gives median ms, speedups over eager, TFLOP/s (the forward is 4*B*K*r*L FLOP, the
backward twice that), every candidate's relative error against float64 (forward and largest
gradient; one off by more than its bound stops the run before timing), and on CUDA whether
the GEMM path meets its target: forward + backward >= :data:`TARGET_FWD_BWD` x eager.
On CPU the Triton candidates run only under ``TRITON_INTERPRET=1``: correct, not speed.

On CUDA, after timing, a few forward + backward iterations of each candidate run under
``torch.profiler`` and their device time per kernel (class GEMM / elementwise / reduction /
..., launches and ms per iteration, share) goes beside the markdown as ``<stem>_kernels.md``
(:mod:`recaccel.bench.kernels.kernel_breakdown`); elsewhere the markdown says it was skipped.

GPU, one command (MLPerf DLRM-DCNv2's cross network)::

    recaccel-bench interaction --kind dcnv2 --batch 16384 --fields 26 --dim 128 --layers 3 \\
        --rank 512 --dtype bfloat16 --repeats 50 --out bench/results/gpu/dcnv2.md --json bench/results/gpu/dcnv2.json
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from itertools import product
from pathlib import Path

import torch
from torch import Tensor

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import write_results_markdown
from recaccel.bench.harness.timing import time_interleaved
from recaccel.bench.kernels.agreement import check_against_float64
from recaccel.bench.kernels.kernel_breakdown import (
    breakdown_path,
    breakdown_rows,
    profile_fwd_bwd,
    write_breakdown,
)
from recaccel.ops.backend import resolve_backend
from recaccel.ops.interaction import dcnv2_cross_reference, init_cross_weights
from recaccel.plotting import pyplot, save_figure

log = logging.getLogger(__name__)

IMPLS = ("eager", "gemm", "fused")
TARGET_FWD_BWD = 1.5
"""The GEMM path's forward + backward must take at most 1/1.5 of eager's time (issue 24, bf16,
B=16384, F=26, D=128, 3 layers, rank 512, on an H100/H200)."""
PROFILE_ITERATIONS = 2  # profiled forward + backward iterations per candidate and shape (CUDA)


def _kernels(device: torch.device) -> dict[str, Callable[..., Tensor]]:
    """The implementations that can run on ``device``: eager always, the Triton ones where launchable."""
    impls: dict[str, Callable[..., Tensor]] = {"eager": dcnv2_cross_reference}
    try:
        resolve_backend("triton", device, op="dcnv2_cross")
    except (RuntimeError, ValueError) as err:
        log.warning("timing eager only: %s", err)
        return impls
    from recaccel.ops.interaction.dcnv2_gemm import dcnv2_cross_gemm
    from recaccel.ops.interaction.dcnv2_triton import dcnv2_cross_triton

    impls.update(gemm=dcnv2_cross_gemm, fused=dcnv2_cross_triton)
    return impls


def _inputs(b: int, k: int, layers: int, rank: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """x0 [B, K] and Glorot weights with small random biases, seeded by the shape."""
    gen = torch.Generator().manual_seed(b * 1_000_003 + k * 1009 + layers * 31 + rank)
    x0 = torch.randn(b, k, generator=gen)
    u, v, bias = init_cross_weights(k, layers, rank, gen)
    bias = torch.randn(bias.shape, generator=gen) * 0.1
    return [t.to(device=device, dtype=dtype) for t in (x0, u, v, bias)]


def _output_grad(b: int, k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The output gradient of a shape, seeded by it."""
    return torch.randn(b, k, generator=torch.Generator().manual_seed(b + k)).to(device=device, dtype=dtype)


def target_verdict(row: dict) -> str:
    """Whether the row's GEMM path meets :data:`TARGET_FWD_BWD` (judged on CUDA only)."""
    speedup = row.get("gemm_fwd_bwd_speedup")
    if speedup is None:
        return "not measured (no GEMM path here)"
    if not row["device"].startswith("cuda"):
        return "not judged (not CUDA: interpreted Triton is no speed)"
    met = "met" if speedup >= TARGET_FWD_BWD else f"not met (short by {TARGET_FWD_BWD - speedup:.2f}x)"
    return f"{met}: gemm fwd+bwd {speedup:.2f}x eager, target >= {TARGET_FWD_BWD}x"


def bench_shape(
    b: int,
    f: int,
    d: int,
    layers: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    warmup: int,
    impls: Mapping[str, Callable[..., Tensor]] | None = None,
) -> dict:
    """One row: every implementation forward and forward + backward, timed interleaved, once
    each has matched the float64 result (forward and every gradient, see
    :func:`~recaccel.bench.kernels.agreement.check_against_float64`).

    Args:
        impls: name -> cross network; default :func:`_kernels` (``eager`` is the reference).

    Raises:
        CandidateMismatchError: an implementation is off by more than the bound; nothing is timed.
    """
    k = d * (f + 1)
    impls = dict(impls) if impls is not None else _kernels(device)
    inputs = _inputs(b, k, layers, rank, dtype, device)
    leaves = [t.detach().requires_grad_() for t in inputs]
    grad = _output_grad(b, k, dtype, device)

    def fwd(fn):
        with torch.no_grad():
            return fn(*inputs)

    def fwd_bwd(fn):
        return torch.autograd.grad(fn(*leaves), leaves, grad)

    candidates = {}
    for name, fn in impls.items():
        candidates[f"{name}_fwd"] = lambda fn=fn: fwd(fn)
        candidates[f"{name}_fwd_bwd"] = lambda fn=fn: fwd_bwd(fn)
    others = {name: fn for name, fn in impls.items() if name != "eager"}
    errors = check_against_float64(
        "dcnv2 bench", impls["eager"], others, inputs, grad, ["x0", "u", "v", "bias"]
    )
    row = {"batch": b, "fields": f, "dim": d, "K": k, "layers": layers, "rank": rank}
    row.update(dtype=str(dtype).removeprefix("torch."), device=str(device))
    for name, err in errors.items():
        row[f"{name}_rel_err"], row[f"{name}_grad_rel_err"] = err["forward"], err["grad"]
    ms = time_interleaved(candidates, repeats, warmup, device)
    flops = 4.0 * b * k * rank * layers  # forward; the backward is twice that
    for name in IMPLS:
        for part, scale in (("fwd", 1), ("fwd_bwd", 3)):
            t = ms.get(f"{name}_{part}")
            row[f"{name}_{part}_ms"] = t
            row[f"{name}_{part}_TFLOPs"] = scale * flops / (t * 1e-3) / 1e12 if t else None
            if name != "eager":
                row[f"{name}_{part}_speedup"] = ms[f"eager_{part}"] / t if t else None
    row["target"] = target_verdict(row)
    return row


def run_dcnv2_bench(
    batch_sizes: Sequence[int],
    num_fields: Sequence[int],
    dims: Sequence[int],
    repeats: int,
    device: torch.device | str,
    json_path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 5,
    layers: int = 3,
    rank: int = 512,
) -> list[dict]:
    """Times eager, GEMM-path and fused cross networks over a grid of shapes.

    Args:
        batch_sizes: B values.
        num_fields: F values (K = D*(F+1)).
        dims: D values.
        repeats: timed calls per candidate per shape (median reported).
        device: where to run.
        json_path: if given, ``{"env": ..., "results": [...]}`` is written there.
        dtype: float32, bfloat16 or float16.
        warmup: untimed calls per candidate first.
        layers: cross layers L.
        rank: rank r.

    Returns:
        One row per shape (see :func:`bench_shape`).
    """
    device = torch.device(device)
    if device.type != "cuda":
        log.warning(
            "%s: Triton runs interpreted if at all; these timings are not performance numbers", device
        )
    rows = []
    for b, f, d in product(batch_sizes, num_fields, dims):
        rows.append(bench_shape(b, f, d, layers, rank, dtype, device, repeats, warmup))
        log.info("dcnv2 %s", rows[-1])
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"env": environment_info(device), "results": rows}, indent=2))
    return rows


def plot_speedups(rows: Sequence[dict], path: str | Path) -> Path:
    """Bars of the GEMM path's and the fused kernel's speedups over eager per shape."""
    plt = pyplot()
    pos = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows)), 4.0))
    bars = [("gemm", "fwd"), ("gemm", "fwd_bwd"), ("fused", "fwd"), ("fused", "fwd_bwd")]
    for i, (name, part) in enumerate(bars):
        values = [r.get(f"{name}_{part}_speedup") or 0.0 for r in rows]
        ax.bar([p - 0.3 + 0.2 * i for p in pos], values, width=0.2, label=f"{name} {part.replace('_', '+')}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(TARGET_FWD_BWD, color="red", linewidth=0.8, linestyle="--", label="target (gemm fwd+bwd)")
    ax.set_xticks(list(pos), [f"B={r['batch']}\nK={r['K']} r={r['rank']}" for r in rows], fontsize=7)
    ax.set_ylabel("speedup over PyTorch eager (x)")
    ax.set_title(f"DCN-v2 cross network ({rows[0]['dtype'] if rows else ''})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def profile_shapes(
    shapes: Sequence[tuple[int, int, int]],
    layers: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    iterations: int = PROFILE_ITERATIONS,
) -> dict[str, list[dict]]:
    """Each candidate's kernels per forward + backward iteration at each (B, F, D) shape
    (:func:`~recaccel.bench.kernels.kernel_breakdown.breakdown_rows`), keyed ``"<name> B=.. K=.."``."""
    impls = _kernels(device)
    tables = {}
    for b, f, d in shapes:
        k = d * (f + 1)
        inputs, grad = _inputs(b, k, layers, rank, dtype, device), _output_grad(b, k, dtype, device)
        for name, fn in impls.items():
            tables[f"{name} B={b} K={k}"] = breakdown_rows(
                profile_fwd_bwd(fn, inputs, grad, device, iterations)
            )
    return tables


def kernel_breakdown_note(args, out: str | Path) -> str:
    """Profiles the candidates on CUDA and writes their kernel tables beside ``out``; returns
    the markdown's note naming the file, or saying why there is none (a profiler failure
    does not end the benchmark: the timed rows stand without it)."""
    device = torch.device(args.device)
    if device.type != "cuda":
        return f"Per-kernel device time: skipped on {device} (the profiler's kernel times need CUDA)."
    dtype = getattr(torch, args.dtype)
    shapes = list(product(args.batch, args.fields, args.dim))
    try:
        tables = profile_shapes(shapes, args.layers, args.rank, dtype, device)
        title = f"DCN-v2 cross network, {args.layers} layers, rank {args.rank}, {args.dtype}, {device}"
        path = write_breakdown(tables, breakdown_path(out), title, PROFILE_ITERATIONS)
    except Exception as e:  # the profiler (CUPTI) can fail where timing did not
        first = (str(e).strip().splitlines() or [""])[0]
        log.warning("dcnv2 kernel table: %s: %s", type(e).__name__, first)
        return f"Per-kernel device time: none ({type(e).__name__}: {first})"[:300]
    return f"Per-kernel device time (GEMM vs elementwise vs reductions, per candidate): {path.name}"


def write_markdown(
    rows: Sequence[dict], path: str | Path, command: str, extra_notes: Sequence[str] = ()
) -> Path:
    """The rows as markdown under the environment and ``command``, each target verdict and
    ``extra_notes`` in the notes."""
    device = rows[0]["device"] if rows else "cpu"
    notes = [
        "eager = per layer matmul, addmm, multiply, add (dcnv2_cross_reference); gemm = library GEMMs "
        "+ one fused elementwise Triton kernel per layer, forward and backward (dcnv2_gemm, "
        'model.dcn_kernel = "gemm", the default); fused = all layers in one Triton launch (dcnv2_triton).',
        "Candidates are timed interleaved within each repeat (order rotating); median ms reported. "
        "fwd_bwd = forward then autograd backward w.r.t. x0 and every weight. TFLOP/s: forward "
        "4*B*K*r*L FLOP, forward+backward three times that.",
        *[f"target B={r['batch']} K={r['K']}: {r['target']}" for r in rows],
        *extra_notes,
    ]
    if not device.startswith("cuda"):
        notes.insert(0, "Not CUDA: Triton runs only interpreted here (or not at all); no figure is a speed.")
    return write_results_markdown(
        path, "DCN-v2 cross network: GEMM path and fused kernel vs PyTorch eager", environment_info(device),
        command, rows, notes,
    )  # fmt: skip


def main(args, command_line: str, plot_path: Path | None) -> Path:
    """``recaccel-bench interaction --kind dcnv2``: runs the sweep, writes markdown (and a plot)."""
    rows = run_dcnv2_bench(
        args.batch,
        args.fields,
        args.dim,
        args.repeats,
        args.device,
        args.json,
        dtype=getattr(torch, args.dtype),
        layers=args.layers,
        rank=args.rank,
    )
    if plot_path is not None:
        plot_speedups(rows, plot_path)
    for row in rows:
        log.info("dcnv2 B=%d K=%d %s: %s", row["batch"], row["K"], row["dtype"], row["target"])
    return write_markdown(rows, args.out, command_line, [kernel_breakdown_note(args, args.out)])
