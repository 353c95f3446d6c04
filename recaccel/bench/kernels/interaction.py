"""Benchmark: a fused Triton interaction vs its PyTorch eager reference.

``--kind dot``: the DLRM dot interaction (eager: bmm + gather + cat). ``--kind dcnv2``:
the DCN-v2 cross network over K = D*(F+1) features, ``--layers`` low-rank layers of
``--rank`` (eager: per layer a matmul, an addmm, a multiply and an add).

For every (batch, fields, dim) the four candidates (eager and Triton, forward alone and
forward+backward) are timed interleaved in one run; each row reports median ms, the
speedup over eager and, on CUDA, the fraction of the copy bandwidth measured in the
same run that the Triton kernels reach on their minimum traffic (each input read
once, each output written once; for dcnv2 the weights too, which is far from its
bound: DCN-v2 is matmul work, so its rows also give TFLOP/s).

The dot candidates take the model's two inputs, dense [B, D] and pooled [B, F, D]: eager
concatenates them and runs bmm + triangle gather + cat (what the model ran before the fused
kernels), Triton reads both in place. ``--dtype tf32`` is float32 inputs with TF32 matmuls
allowed for both; ``--pad`` pads the output row to a multiple of 8 elements.
``--roofline-cases`` runs the two shapes of issue 24 (B=65536, F=26, D=128 and B=4096,
F=500, D=32) in bf16 and tf32 and says per row whether forward beats eager and forward +
backward reaches 60 % of its byte roofline (the copy bandwidth measured in the run).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from itertools import product
from pathlib import Path

import torch

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import add_output_args, plot_file, write_results_markdown
from recaccel.bench.harness.timing import measure_copy_bandwidth, time_interleaved
from recaccel.bench.kernels.agreement import check_against_float64
from recaccel.errors import ConfigError
from recaccel.ops.backend import resolve_backend
from recaccel.ops.interaction import (
    dcnv2_cross_reference,
    dot_interaction_reference,
    init_cross_weights,
    interaction_output_dim,
)
from recaccel.ops.tf32 import tf32
from recaccel.plotting import pyplot, save_figure

log = logging.getLogger(__name__)

CANDIDATES = ("eager_fwd", "triton_fwd", "eager_fwd_bwd", "triton_fwd_bwd")
KINDS = ("dot", "dcnv2")
# --dtype choices: "tf32" = float32 tensors, TF32 matmuls allowed while timing.
PRECISIONS = {
    "float32": torch.float32,
    "tf32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Issue 24's dot interaction cases (B, F, D), each in bf16 and tf32, and its bar.
ROOFLINE_CASES = ((65536, 26, 128), (4096, 500, 32))
ROOFLINE_PRECISIONS = ("bfloat16", "tf32")
ROOFLINE_TARGET = 0.60


def _as_list(value: int | Sequence[int]) -> list[int]:
    return [value] if isinstance(value, int) else list(value)


@contextlib.contextmanager
def _tf32(allow: bool) -> Iterator[None]:
    """TF32 matmuls allowed (or not) inside, restored after."""
    with tf32(allow):
        yield


def _min_bytes(b: int, f: int, d: int, elem: int, pad: bool = False) -> tuple[int, int]:
    """Fewest bytes moved by forward, and by forward+backward, for [B, F+1, D] input."""
    x = b * (f + 1) * d * elem
    out = b * interaction_output_dim(f, d, pad=pad) * elem
    fwd = x + out
    bwd = x + out + x  # read x and grad_out, write grad_x
    return fwd, fwd + bwd


def _triton_fn(device: torch.device, kind: str = "dot"):
    """The Triton entry point of ``kind``, or None (with a warning) where it cannot run."""
    op = "dot_interaction" if kind == "dot" else "dcnv2_cross"
    try:
        resolve_backend("triton", device, op=op)
    except (RuntimeError, ValueError) as err:
        log.warning("skipping the triton candidates: %s", err)
        return None
    if kind == "dcnv2":
        from recaccel.ops.interaction.dcnv2_triton import dcnv2_cross_triton

        return dcnv2_cross_triton
    from recaccel.ops.interaction.triton import dot_interaction_pair_triton

    return dot_interaction_pair_triton


def _dot_case(b, f, d, dtype, device, gen, pad=False) -> tuple[list, int, int, int]:
    """(inputs dense and pooled, output width, fewest forward bytes, fewest forward+backward
    bytes) of a dot shape."""
    # Scaled so dot products are O(1) in every dtype; never zeros (see METHOD notes).
    dense = (torch.randn(b, d, generator=gen, device=device) / d**0.25).to(dtype)
    pooled = (torch.randn(b, f, d, generator=gen, device=device) / d**0.25).to(dtype)
    fwd, fwd_bwd = _min_bytes(b, f, d, dense.element_size(), pad)
    return [dense, pooled], interaction_output_dim(f, d, pad=pad), fwd, fwd_bwd


def _dot_eager(pad: bool):
    """The eager dot candidate: cat, then bmm + triangle gather + cat."""
    return lambda dense, pooled: dot_interaction_reference(torch.cat([dense.unsqueeze(1), pooled], 1), pad)


def _dcnv2_case(b, f, d, layers, rank, dtype, device, gen) -> tuple[list, int, int, int]:
    """As :func:`_dot_case` for the cross network over K = D*(F+1) features."""
    k = d * (f + 1)
    x0 = torch.randn(b, k, generator=gen, device=device).to(dtype)
    weights = [w.to(device=device, dtype=dtype) for w in init_cross_weights(k, layers, rank)]
    elem = x0.element_size()
    io = 2 * b * k * elem  # x0 read, x_L written
    w_bytes = sum(w.numel() for w in weights) * elem
    # backward: grad_out and x0 read, grad_x0 written; weights read, their gradients written
    return [x0, *weights], k, io + w_bytes, io + w_bytes + 3 * b * k * elem + 2 * w_bytes


def _dcnv2_flops(b: int, k: int, layers: int, rank: int) -> float:
    """Multiply-adds x 2 of the forward: two [B, K] x [K, r]-sized matmuls per layer."""
    return 2.0 * 2 * b * k * rank * layers


def _bench_one(
    b, f, d, dtype, device, repeats, warmup, triton_fn, copy_gbps, kind="dot", layers=3, rank=512, pad=False
) -> dict:
    gen = torch.Generator(device=device).manual_seed(b * 1_000_003 + f * 1009 + d)
    if kind == "dcnv2":
        inputs, width, fwd_bytes, fwd_bwd_bytes = _dcnv2_case(b, f, d, layers, rank, dtype, device, gen)
        reference = dcnv2_cross_reference
    else:
        inputs, width, fwd_bytes, fwd_bwd_bytes = _dot_case(b, f, d, dtype, device, gen, pad)
        reference = _dot_eager(pad)
        if triton_fn is not None:
            fused = triton_fn
            triton_fn = lambda dense, pooled: fused(dense, pooled, pad)  # noqa: E731
    grad = torch.randn(b, width, generator=gen, device=device).to(dtype)
    leaves = [t.detach().requires_grad_() for t in inputs]

    def fwd(fn):
        with torch.no_grad():
            return fn(*inputs)

    def fwd_bwd(fn):
        return torch.autograd.grad(fn(*leaves), leaves, grad)

    candidates = {
        "eager_fwd": lambda: fwd(reference),
        "eager_fwd_bwd": lambda: fwd_bwd(reference),
    }
    row = {
        "batch": b,
        "fields": f,
        "dim": d,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "kind": kind,
    }
    if kind == "dcnv2":
        row.update(layers=layers, rank=rank)
    else:
        row["pad"] = pad
    if triton_fn is not None:
        candidates["triton_fwd"] = lambda: fwd(triton_fn)
        candidates["triton_fwd_bwd"] = lambda: fwd_bwd(triton_fn)
        names = ["x0", "u", "v", "bias"] if kind == "dcnv2" else ["dense", "pooled"]
        errors = check_against_float64(
            f"{kind} interaction bench", reference, {"triton": triton_fn}, inputs, grad, names
        )["triton"]
        row["max_rel_err"], row["max_rel_err_grad"] = errors["forward"], errors["grad"]
    ms = time_interleaved(candidates, repeats, warmup, device)
    for name in CANDIDATES:
        row[f"{name}_ms"] = ms.get(name)
    if triton_fn is not None:
        row["fwd_speedup"] = ms["eager_fwd"] / ms["triton_fwd"]
        row["fwd_bwd_speedup"] = ms["eager_fwd_bwd"] / ms["triton_fwd_bwd"]
    if kind == "dcnv2":
        flops = _dcnv2_flops(b, width, layers, rank)
        for name in ("eager_fwd", "triton_fwd"):
            if ms.get(name):
                row[f"{name}_TFLOPs"] = flops / (ms[name] * 1e-3) / 1e12
    if copy_gbps is not None and triton_fn is not None:
        row["triton_fwd_GBps"] = fwd_bytes / (ms["triton_fwd"] * 1e-3) / 1e9
        row["triton_fwd_bw_frac"] = row["triton_fwd_GBps"] / copy_gbps
        row["triton_fwd_bwd_bw_frac"] = fwd_bwd_bytes / (ms["triton_fwd_bwd"] * 1e-3) / 1e9 / copy_gbps
        row["copy_GBps"] = copy_gbps
    return row


def run_interaction_bench(
    batch_sizes: int | Sequence[int],
    num_fields: int | Sequence[int],
    dims: int | Sequence[int],
    repeats: int,
    device: torch.device | str,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    warmup: int = 5,
    kind: str = "dot",
    layers: int = 3,
    rank: int = 512,
    tf32: bool = False,
    pad: bool = False,
) -> list[dict]:
    """Times eager vs Triton interaction (``kind``: dot or dcnv2) over a grid of shapes.

    Args:
        batch_sizes: B values.
        num_fields: F values (sparse fields; the input has F+1 rows).
        dims: D values.
        repeats: Timed calls per candidate per shape (median reported).
        device: Where to run. Triton candidates need CUDA (or ``TRITON_INTERPRET=1``,
            whose timings mean nothing); without them only eager is timed.
        json_path: If given, writes ``{"env": ..., "results": [...]}`` there.
        plot_path: If given, writes a PNG of the speedups there.
        dtype: Input dtype (float32, bfloat16 or float16).
        warmup: Untimed calls per candidate first.
        kind: ``"dot"`` or ``"dcnv2"`` (the cross network over K = D*(F+1) features).
        layers: dcnv2 cross layers L.
        rank: dcnv2 rank r.
        tf32: Allow TF32 matmuls (eager and Triton) while timing float32 inputs.
        pad: dot: pad the output row to a multiple of 8 elements.

    Returns:
        One dict per shape: kind, batch, fields, dim, dtype, precision (``float32``,
        ``tf32``, ``bfloat16`` or ``float16``), device, ``<candidate>_ms``,
        speedups, the Triton path's relative errors against float64 (``max_rel_err``
        forward, ``max_rel_err_grad`` the largest gradient's), on CUDA bandwidth
        fractions; for dcnv2 also layers, rank and forward TFLOP/s.

    Raises:
        ValueError: an unknown kind.
        CandidateMismatchError: the Triton path's forward or a gradient is off by more than
            the bound of :mod:`recaccel.bench.kernels.agreement` (checked before timing).
    """
    if kind not in KINDS:
        raise ValueError(f"interaction bench: kind must be one of {KINDS}, got {kind!r}")
    device = torch.device(device)
    triton_fn = _triton_fn(device, kind)
    if triton_fn is not None and device.type != "cuda":
        log.warning("triton runs interpreted on %s: its timings are not performance numbers", device)
    copy_gbps = measure_copy_bandwidth(device) if device.type == "cuda" else None
    precision = "tf32" if tf32 and dtype == torch.float32 else str(dtype).removeprefix("torch.")
    results = []
    for b, f, d in product(_as_list(batch_sizes), _as_list(num_fields), _as_list(dims)):
        with _tf32(precision == "tf32"):
            row = _bench_one(
                b, f, d, dtype, device, repeats, warmup, triton_fn, copy_gbps, kind, layers, rank, pad
            )
        results.append({**row, "precision": precision})
        log.info("%s interaction %s", kind, results[-1])
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(
            json.dumps({"env": environment_info(device), "results": results}, indent=2)
        )
    if plot_path is not None:
        plot_speedups(results, plot_path)
    return results


def run_roofline_cases(
    repeats: int,
    device: torch.device | str,
    json_path: str | Path | None = None,
    *,
    cases: Sequence[tuple[int, int, int]] = ROOFLINE_CASES,
    precisions: Sequence[str] = ROOFLINE_PRECISIONS,
    warmup: int = 5,
    pad: bool = True,
) -> list[dict]:
    """Issue 24's dot interaction bars: every (B, F, D) of ``cases`` in every precision.

    Each row is a :func:`run_interaction_bench` row plus ``fwd_beats_eager`` and
    ``roofline_target_met`` (forward + backward at >= :data:`ROOFLINE_TARGET` of the byte
    roofline); both None where the Triton or the bandwidth figures are missing (off CUDA).

    Args:
        repeats: Timed calls per candidate.
        device: Where to run.
        json_path: If given, writes ``{"env": ..., "results": [...]}`` there.
        cases: (B, F, D) shapes; the defaults are the issue's.
        precisions: keys of :data:`PRECISIONS`.
        warmup: Untimed calls per candidate first.
        pad: Pad the output row to a multiple of 8 elements (as the model will).

    Returns:
        One row per (precision, case).
    """
    results = []
    for precision in precisions:
        for b, f, d in cases:
            (row,) = run_interaction_bench(
                b, f, d, repeats, device, dtype=PRECISIONS[precision], warmup=warmup,
                tf32=precision == "tf32", pad=pad,
            )  # fmt: skip
            frac = row.get("triton_fwd_bwd_bw_frac")
            row["fwd_beats_eager"] = None if row.get("fwd_speedup") is None else row["fwd_speedup"] > 1.0
            row["roofline_target_met"] = None if frac is None else frac >= ROOFLINE_TARGET
            results.append(row)
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(
            json.dumps({"env": environment_info(torch.device(device)), "results": results}, indent=2)
        )
    return results


def plot_speedups(results: Sequence[dict], path: str | Path) -> Path:
    """Bar chart of Triton's speedup over eager (forward, forward+backward) per shape."""
    plt = pyplot()

    labels = [f"B={r['batch']}\nF={r['fields']} D={r['dim']}" for r in results]
    fwd = [r.get("fwd_speedup") or 0.0 for r in results]
    fwd_bwd = [r.get("fwd_bwd_speedup") or 0.0 for r in results]
    pos = range(len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(results)), 4.0))
    ax.bar([p - 0.2 for p in pos], fwd, width=0.4, label="forward")
    ax.bar([p + 0.2 for p in pos], fwd_bwd, width=0.4, label="forward+backward")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(pos), labels, fontsize=7)
    ax.set_ylabel("speedup over PyTorch eager (x)")
    dtype = results[0]["dtype"] if results else ""
    kind = "DCN-v2 cross network" if results and results[0].get("kind") == "dcnv2" else "Dot interaction"
    ax.set_title(f"{kind}, Triton fused vs eager ({dtype})")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def write_markdown_summary(results: Sequence[dict], path: str | Path, command: str) -> Path:
    """Writes ``results`` as markdown with device, versions, date and ``command`` on top."""
    device = results[0]["device"] if results else "cpu"
    notes = (
        []
        if device.startswith("cuda")
        else [
            "Not CUDA: Triton is timed only on CUDA (on CPU it runs only under its interpreter, "
            "whose times are not speed); '-' = not timed, so this run shows the eager baseline alone."
        ]
    )
    dcn = bool(results) and results[0].get("kind") == "dcnv2"
    eager = (
        (
            "eager = per layer matmul, addmm, multiply, add over K = D*(F+1) features "
            "(recaccel.ops.interaction.dcnv2_cross_reference); triton = all layers in one launch "
            "forward, the backward chain in one launch plus batched matmuls for the weight "
            "gradients (recaccel.ops.interaction.dcnv2_triton)."
        )
        if dcn
        else (
            "eager = bmm + triu gather + cat (recaccel.ops.interaction.dot_interaction_reference); "
            "triton = fused kernels (recaccel.ops.interaction.triton)."
        )
    )
    notes += [
        "Candidates are timed interleaved within each repeat (order rotating); median ms reported.",
        eager,
        "fwd_bwd = forward then autograd backward w.r.t. every input (dcnv2: x0 and the weights).",
        "Checked before timing, on the timed inputs: the Triton path's forward and every gradient are "
        "within 4x eager's own relative error + 1e-3 of the float64 result (max_rel_err, max_rel_err_grad).",
        (
            "bw_frac = minimum bytes (inputs read once, outputs written once) / time, over the "
            "device-to-device copy bandwidth (read + write) measured in the same run."
        ),
    ]
    return write_results_markdown(
        path,
        f"{'DCN-v2 cross network' if dcn else 'Dot interaction'}: Triton fused vs PyTorch eager",
        environment_info(device),
        command,
        results,
        notes,
    )


def add_args(parser) -> None:
    """``recaccel-bench interaction`` options."""
    parser.add_argument(
        "--kind", choices=KINDS, default="dot", help="dot interaction or the DCN-v2 cross network"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[2048, 16384], help="batch sizes B")
    parser.add_argument(
        "--fields", type=int, nargs="+", default=[26], help="sparse fields F (input has F+1 rows)"
    )
    parser.add_argument("--dim", type=int, nargs="+", default=[128], help="embedding dims D")
    parser.add_argument("--layers", type=int, default=3, help="dcnv2: cross layers L")
    parser.add_argument("--rank", type=int, default=512, help="dcnv2: rank r of each layer")
    parser.add_argument(
        "--dtype", choices=list(PRECISIONS), default="float32", help="tf32: float32 tensors, TF32 matmuls"
    )
    parser.add_argument("--pad", action="store_true", help="dot: pad the output row to a multiple of 8")
    parser.add_argument(
        "--roofline-cases",
        action="store_true",
        help="dot: issue 24's shapes (B=65536 F=26 D=128; B=4096 F=500 D=32) in bf16 and tf32, "
        "padded, with their bars; ignores --batch/--fields/--dim/--dtype",
    )
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per candidate (median)")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if present)",
    )
    parser.add_argument("--json", help="write machine-readable results here")
    add_output_args(parser, "interaction", plot="the speedups")


def main(args, command_line: str) -> Path:
    """Runs the sweep and writes the markdown summary; returns its path."""
    if args.kind == "dcnv2" and args.dtype == "tf32":
        raise ConfigError("recaccel-bench interaction: --dtype tf32 is for --kind dot only")
    if args.kind == "dcnv2":  # eager vs the GEMM path vs the fused kernel: recaccel.bench.kernels.dcnv2
        from recaccel.bench.kernels import dcnv2

        return dcnv2.main(args, command_line, plot_file(args))
    if args.roofline_cases:
        results = run_roofline_cases(args.repeats, args.device, args.json)
        return write_markdown_summary(results, args.out, command_line)
    results = run_interaction_bench(
        args.batch,
        args.fields,
        args.dim,
        args.repeats,
        args.device,
        args.json,
        plot_file(args),
        dtype=PRECISIONS[args.dtype],
        kind=args.kind,
        tf32=args.dtype == "tf32",
        pad=args.pad,
        layers=args.layers,
        rank=args.rank,
    )
    return write_markdown_summary(results, args.out, command_line)
