"""Benchmark: fused Triton dot interaction vs the PyTorch eager reference (bmm + gather + cat).

For every (batch, fields, dim) the four candidates (eager and Triton, forward alone and
forward+backward) are timed interleaved in one run; each row reports median ms, the
speedup over eager and, on CUDA, the fraction of the copy bandwidth measured in the
same run that the Triton kernels reach on their minimum traffic (each input read
once, each output written once).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from itertools import product
from pathlib import Path

import torch

from recaccel.bench.common import (
    add_output_args,
    environment_info,
    measure_copy_bandwidth,
    plot_file,
    pyplot,
    save_figure,
    time_interleaved,
    write_results_markdown,
)
from recaccel.ops.backend import resolve_backend
from recaccel.ops.interaction import dot_interaction_reference, interaction_output_dim

log = logging.getLogger(__name__)

CANDIDATES = ("eager_fwd", "triton_fwd", "eager_fwd_bwd", "triton_fwd_bwd")


def _as_list(value: int | Sequence[int]) -> list[int]:
    return [value] if isinstance(value, int) else list(value)


def _min_bytes(b: int, f: int, d: int, elem: int) -> tuple[int, int]:
    """Fewest bytes moved by forward, and by forward+backward, for [B, F+1, D] input."""
    x = b * (f + 1) * d * elem
    out = b * interaction_output_dim(f, d) * elem
    fwd = x + out
    bwd = x + out + x  # read x and grad_out, write grad_x
    return fwd, fwd + bwd


def _triton_fn(device: torch.device):
    """The Triton entry point, or None (with a warning) where it cannot run."""
    try:
        resolve_backend("triton", device, op="dot_interaction")
    except (RuntimeError, ValueError) as err:
        log.warning("skipping the triton candidates: %s", err)
        return None
    from recaccel.ops.interaction.triton import dot_interaction_triton

    return dot_interaction_triton


def _bench_one(b, f, d, dtype, device, repeats, warmup, triton_fn, copy_gbps) -> dict:
    gen = torch.Generator(device=device).manual_seed(b * 1_000_003 + f * 1009 + d)
    # Scaled so dot products are O(1) in every dtype; never zeros (see METHOD notes).
    x = (torch.randn(b, f + 1, d, generator=gen, device=device) / d**0.25).to(dtype)
    grad = torch.randn(b, interaction_output_dim(f, d), generator=gen, device=device).to(dtype)
    x_req = x.detach().requires_grad_()

    def fwd(fn):
        with torch.no_grad():
            return fn(x)

    def fwd_bwd(fn):
        return torch.autograd.grad(fn(x_req), x_req, grad)

    candidates = {
        "eager_fwd": lambda: fwd(dot_interaction_reference),
        "eager_fwd_bwd": lambda: fwd_bwd(dot_interaction_reference),
    }
    row = {
        "batch": b,
        "fields": f,
        "dim": d,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
    }
    if triton_fn is not None:
        candidates["triton_fwd"] = lambda: fwd(triton_fn)
        candidates["triton_fwd_bwd"] = lambda: fwd_bwd(triton_fn)
        ref = fwd(dot_interaction_reference).double()
        row["max_rel_err"] = float((fwd(triton_fn).double() - ref).norm() / ref.norm().clamp_min(1e-30))
    ms = time_interleaved(candidates, repeats, warmup, device)
    for name in CANDIDATES:
        row[f"{name}_ms"] = ms.get(name)
    if triton_fn is not None:
        row["fwd_speedup"] = ms["eager_fwd"] / ms["triton_fwd"]
        row["fwd_bwd_speedup"] = ms["eager_fwd_bwd"] / ms["triton_fwd_bwd"]
    if copy_gbps is not None and triton_fn is not None:
        fwd_bytes, fwd_bwd_bytes = _min_bytes(b, f, d, x.element_size())
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
) -> list[dict]:
    """Times eager vs Triton dot interaction over a grid of shapes.

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

    Returns:
        One dict per shape: batch, fields, dim, dtype, device, ``<candidate>_ms``, speedups,
        the Triton path's relative error, and on CUDA bandwidth fractions.
    """
    device = torch.device(device)
    triton_fn = _triton_fn(device)
    if triton_fn is not None and device.type != "cuda":
        log.warning("triton runs interpreted on %s: its timings are not performance numbers", device)
    copy_gbps = measure_copy_bandwidth(device) if device.type == "cuda" else None
    results = []
    for b, f, d in product(_as_list(batch_sizes), _as_list(num_fields), _as_list(dims)):
        results.append(_bench_one(b, f, d, dtype, device, repeats, warmup, triton_fn, copy_gbps))
        log.info("dot interaction %s", results[-1])
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(
            json.dumps({"env": environment_info(device), "results": results}, indent=2)
        )
    if plot_path is not None:
        plot_speedups(results, plot_path)
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
    ax.set_title(f"Dot interaction, Triton fused vs eager ({dtype})")
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
    notes += [
        "Candidates are timed interleaved within each repeat (order rotating); median ms reported.",
        (
            "eager = bmm + triu gather + cat (recaccel.ops.interaction.dot_interaction_reference); "
            "triton = fused kernels (recaccel.ops.interaction.triton)."
        ),
        "fwd_bwd = forward then autograd backward w.r.t. the input.",
        (
            "bw_frac = minimum bytes (inputs read once, outputs written once) / time, over the "
            "device-to-device copy bandwidth (read + write) measured in the same run."
        ),
    ]
    return write_results_markdown(
        path,
        "Dot interaction: Triton fused vs PyTorch eager",
        environment_info(device),
        command,
        results,
        notes,
    )


def add_args(parser) -> None:
    """``recaccel-bench interaction`` options."""
    parser.add_argument("--batch", type=int, nargs="+", default=[2048, 16384], help="batch sizes B")
    parser.add_argument(
        "--fields", type=int, nargs="+", default=[26], help="sparse fields F (input has F+1 rows)"
    )
    parser.add_argument("--dim", type=int, nargs="+", default=[128], help="embedding dims D")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write machine-readable results here")
    add_output_args(parser, "interaction", plot="the speedups")


def main(args, command_line: str) -> Path:
    """Runs the sweep and writes the markdown summary; returns its path."""
    results = run_interaction_bench(
        args.batch,
        args.fields,
        args.dim,
        args.repeats,
        args.device,
        args.json,
        plot_file(args),
        dtype=getattr(torch, args.dtype),
    )
    return write_markdown_summary(results, args.out, command_line)
