"""Benchmark of the dense head's MLPs and dense optimizer: the fast path against plain layers.

Per precision (``fp32``: strict float32; ``tf32``: float32 matmuls on tensor cores;
``bf16``: autocast) the bottom and top MLPs of a preset shape run forward + backward
(w.r.t. the input and every parameter), timed interleaved:

- ``plain``: ``nn.Linear`` + ``nn.ReLU`` as separate kernels, unaligned inner dimensions
  (the layers as they were);
- ``fast``: bias + ReLU in the GEMM epilogue and inner dimensions padded to 8
  (:mod:`recaccel.models.fused_linear`, the default on CUDA).

Then one dense optimizer step over the same parameters: Adam ``foreach`` against Adam
``fused`` (:func:`recaccel.train.model.optim.implementation`; CUDA only). Each row gives median
ms, TFLOP/s (forward 2*B*sum(K*N), backward twice that), the share of the bf16 matmul rate
measured in the same run (8192^3), and each candidate's largest relative error in the
outputs and in the gradients against the same layers in float64. Before timing, a fast path
whose error exceeds :data:`ERROR_FACTOR` times the plain layers' own plus
:data:`ERROR_FLOOR` stops the run: the precision's own error is the yardstick (in bf16 a
ReLU unit whose pre-activation rounds to the other side of zero moves an input gradient by
~10%, in either candidate, so fast against plain says nothing finer).

GPU, one command (the criteo MLPs, 13-512-256-128 and 479-1024-1024-512-256-1, B=65536)::

    python -m recaccel.bench.kernels.dense_mlp --batch 65536 --out bench/results/gpu/dense_mlp.md \\
        --json bench/results/gpu/dense_mlp.json

On CPU (``--batch 64``, the default there) it checks that every candidate runs; its times
say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from recaccel.bench.harness.environment import environment_info
from recaccel.bench.harness.report import write_results_markdown
from recaccel.bench.harness.timing import time_interleaved
from recaccel.bench.kernels.agreement import max_relative_error
from recaccel.errors import RecaccelError
from recaccel.models.arches import MLP, mlp
from recaccel.ops.tf32 import tf32
from recaccel.train.model.optim import implementation

PRECISIONS = ("fp32", "tf32", "bf16")
# The fast path's relative error against float64 may be this many times the plain layers'
# own, plus the floor (which covers a plain error that happens to be near zero).
ERROR_FACTOR = 4.0
ERROR_FLOOR = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 1e-2}
BOTTOM = (13, [512, 256, 128])
TOP = (479, [1024, 1024, 512, 256, 1])


def add_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--batch", type=int, help="rows per step (default 65536 on CUDA, 64 on CPU)")
    parser.add_argument("--precision", default=",".join(PRECISIONS), help="comma-separated of fp32,tf32,bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/dense_mlp.md", help="markdown summary")
    parser.add_argument("--json", help="also write the rows as JSON here")


@contextlib.contextmanager
def precision_mode(precision: str, device: torch.device) -> Iterator[None]:
    """Runs the block in ``precision``: TF32 matmuls for ``tf32``, bf16 autocast for ``bf16``."""
    with (
        tf32(precision == "tf32"),
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"),
    ):
        yield


def build_mlps(device: torch.device, *, fast: bool, seed: int = 0) -> list[MLP]:
    """The bottom and top MLPs (same weights for a given seed), fast path on or off."""
    torch.manual_seed(seed)
    mlps = [mlp(BOTTOM[0], BOTTOM[1], final_activation=True), mlp(TOP[0], TOP[1], final_activation=False)]
    for m in mlps:
        m.fused = m.align = fast
    return [m.to(device) for m in mlps]


def mlp_flops(batch: int) -> int:
    """Forward + backward FLOP of both MLPs at ``batch`` rows (backward = 2x forward)."""
    macs = 0
    for k, sizes in (BOTTOM, TOP):
        for n in sizes:
            macs += k * n
            k = n
    return 3 * 2 * batch * macs


def step_fn(
    mlps: list[MLP], inputs: list[Tensor], precision: str, device: torch.device
) -> Callable[[], list[Tensor]]:
    """One forward + backward of both MLPs; returns the concatenated outputs (detached), then
    the gradients of the inputs and of every parameter."""
    params = [p for m in mlps for p in m.parameters()]

    def step() -> list[Tensor]:
        with precision_mode(precision, device):
            outs = [m(x) for m, x in zip(mlps, inputs, strict=True)]
        loss = sum(o.float().sum() for o in outs)
        grads = torch.autograd.grad(loss, [*inputs, *params])
        return [torch.cat([o.detach().float().flatten() for o in outs]), *grads]

    return step


def relative_errors(reference: list[Tensor], got: list[Tensor]) -> list[float]:
    """Per tensor, :func:`~recaccel.bench.kernels.agreement.max_relative_error` against ``reference``."""
    return [max_relative_error(have, want) for want, have in zip(reference, got, strict=True)]


def check_fast_path(
    reference: list[Tensor], plain: list[Tensor], fast: list[Tensor], precision: str
) -> tuple[list[float], list[float]]:
    """Both candidates' outputs and gradients against float64 (see :data:`ERROR_FACTOR`).

    Args:
        reference: The float64 layers' outputs, then gradients (inputs, then parameters).
        plain: The plain layers' in ``precision``, in the same order.
        fast: The fast path's.
        precision: ``fp32``, ``tf32`` or ``bf16``.

    Returns:
        (plain's relative errors, fast's), one per tensor.

    Raises:
        RecaccelError: one line naming the output or gradient; the timing would be void.
    """
    plain_err, fast_err = relative_errors(reference, plain), relative_errors(reference, fast)
    for i, (own, err) in enumerate(zip(plain_err, fast_err, strict=True)):
        bound = ERROR_FACTOR * own + ERROR_FLOOR[precision]
        if not err <= bound:  # NaN fails too
            what = "outputs" if i == 0 else f"gradient {i} (inputs, then parameters)"
            raise RecaccelError(
                f"dense_mlp bench: the fast path's {what} in {precision} are {err:.3g} from float64 "
                f"(max |diff| / max |float64|), the plain layers' {own:.3g}: over {bound:.3g}; nothing is timed"
            )
    return plain_err, fast_err


def bf16_matmul_tflops(device: torch.device, repeats: int, warmup: int) -> float | None:
    """The bf16 8192^3 matmul rate on CUDA (TFLOP/s); None elsewhere."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = time_interleaved({"mm": lambda: a @ a}, repeats, warmup, device)["mm"]
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def mlp_rows(args, device: torch.device, batch: int, matmul: float | None) -> list[dict]:
    """One row per (precision, candidate): ms, TFLOP/s, share of the bf16 matmul rate, error."""
    gen = torch.Generator(device=device).manual_seed(1)
    inputs = [
        torch.randn(batch, k, device=device, generator=gen, requires_grad=True) for k in (BOTTOM[0], TOP[0])
    ]
    mlps = {"plain": build_mlps(device, fast=False), "fast": build_mlps(device, fast=True)}
    # The same layers and inputs in float64 (plain layers: no fast path outside 32/16 bits).
    exact_inputs = [x.detach().double().requires_grad_() for x in inputs]
    reference = step_fn([m.double() for m in build_mlps(device, fast=False)], exact_inputs, "fp32", device)()
    rows = []
    for precision in args.precision.split(","):
        steps = {name: step_fn(m, inputs, precision, device) for name, m in mlps.items()}
        errors = dict(
            zip(("plain", "fast"), check_fast_path(reference, steps["plain"](), steps["fast"](), precision))
        )
        times = time_interleaved(steps, args.repeats, args.warmup, device)
        for name, ms in times.items():
            tflops = mlp_flops(batch) / (ms * 1e-3) / 1e12
            rows.append(
                {
                    "what": "mlps fwd+bwd",
                    "precision": precision,
                    "candidate": name,
                    "ms": round(ms, 4),
                    "speedup": round(times["plain"] / ms, 3),
                    "tflops": round(tflops, 2),
                    "of_bf16_matmul": round(tflops / matmul, 3) if matmul else None,
                    "max_rel_err": errors[name][0],
                    "max_rel_err_grad": max(errors[name][1:]),
                }
            )
    return rows


def optimizer_rows(args, device: torch.device) -> list[dict]:
    """Adam ``foreach`` against ``fused`` (CUDA only) over the MLPs' parameters."""
    if implementation("adam", [device])["fused"] is not True:
        return []
    optimizers = {}
    for name, flags in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = [p for m in build_mlps(device, fast=True) for p in m.parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizers[name] = torch.optim.Adam(params, lr=1e-3, **flags)
    times = time_interleaved({n: o.step for n, o in optimizers.items()}, args.repeats, args.warmup, device)
    return [
        {
            "what": "adam step",
            "precision": "fp32",
            "candidate": n,
            "ms": round(ms, 4),
            "speedup": round(times["foreach"] / ms, 3),
        }
        for n, ms in times.items()
    ]


def main(args, command_line: str) -> Path:
    """Runs the benchmark; writes the markdown (and ``--json``); returns the markdown's path."""
    device = torch.device(args.device)
    batch = args.batch or (65536 if device.type == "cuda" else 64)
    matmul = bf16_matmul_tflops(device, args.repeats, args.warmup)
    rows = mlp_rows(args, device, batch, matmul) + optimizer_rows(args, device)
    env = {**environment_info(device), "batch": batch, "bf16_matmul_tflops": matmul}
    notes = ["fast = bias+ReLU in the cuBLASLt epilogue and inner dims padded to 8; plain = Linear, ReLU"]
    if device.type != "cuda":
        notes.append("CPU run: checks the candidates run and agree; the times say nothing about a GPU")
    out = write_results_markdown(args.out, "Dense MLPs and optimizer", env, command_line, rows, notes)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m recaccel.bench.kernels.dense_mlp", description=__doc__.split("\n")[0]
    )
    add_args(parser)
    parsed = parser.parse_args()
    main(parsed, shlex.join(["python", "-m", "recaccel.bench.kernels.dense_mlp", *sys.argv[1:]]))
