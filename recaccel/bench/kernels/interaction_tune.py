"""``recaccel-bench interaction_tune``: the Triton dot interaction's launch-config sweep.

One command on a lent H100/H200, about 2 minutes (``--budget-s``, 150 by default)::

    T=recaccel/ops/interaction/tuning_table.py
    recaccel-bench interaction_tune --json $OUT/interaction_tune.json --out $OUT/interaction_tune.md --write-table $T
    cp $T $OUT/   # commit it with the JSON

Per case (forward and backward of the DLRM shapes: R=501 of D=32 at B=4,096 and R=27 rows
of D=128 at B=65,536, each in bf16 and TF32, then R=27 in strict float32 at B=16,384), most
important first: the heuristic's config (``default``, what runs untuned), then every
candidate (batch rows per program, column chunk, warps, and on the tile-pair grid of R > 64
the row tile; register tiles of at most 8192 elements) compiled at once on a thread pool,
each checked against the default's output (a config that differs, or fails to compile, is
dropped, not timed) and timed alone with
``triton.testing.do_bench``. Figures: ms, GB/s of the minimum bytes (inputs read once,
outputs written once), % of the copy bandwidth measured in the same run. The JSON is
rewritten after every case; cases left when the budget is spent are listed as skipped.
``--write-table`` merges each shape key's fastest config into the tuning table the
kernels read on that device (:mod:`recaccel.ops.interaction.tuning`). ``--device cpu``
runs one tiny case per kernel, 2 configs each, under the Triton interpreter (a check that
everything runs; its times mean nothing).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from recaccel.bench.harness.report import add_output_args
from recaccel.bench.kernels.config_sweep import (
    finish,
    pick_winners,
    resolve_device,
    run_cases,
    time_candidates,
)
from recaccel.bench.kernels.sweep_cases import Candidate

if TYPE_CHECKING:
    from recaccel.ops.interaction.launch_plan import KernelConfig

MAX_TILE_ELEMENTS = 8192  # block_b x BT x max(BT, BD): the register tile a candidate may hold


@dataclasses.dataclass(frozen=True)
class TuneCase:
    """One kernel at one shape and precision.

    Attributes:
        kernel: ``fwd`` or ``bwd``.
        batch: B.
        fields: F pooled rows (R = F + 1 with the dense row).
        dim: D.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        tf32: float32 products on TF32 tensor cores (torch's switch), else three-pass TF32.
    """

    kernel: Literal["fwd", "bwd"]
    batch: int
    fields: int
    dim: int
    dtype: str
    tf32: bool = False

    @property
    def name(self) -> str:
        mode = "_tf32" if self.dtype == "float32" and self.tf32 else ""
        return f"{self.kernel}_B{self.batch}_R{self.fields + 1}_D{self.dim}_{self.dtype}{mode}"


def gpu_cases() -> list[TuneCase]:
    """The CUDA cases, most important first (each kernel of each shape): bench_wide's R=501
    leads, the furthest from its roofline (20-44% on the H200, session 15) and the one with
    row-tile candidates; a case the budget leaves out keeps its table entry from an earlier run."""
    shapes = [
        (4096, 500, 32, "bfloat16", False),  # bench_wide
        (4096, 500, 32, "float32", True),
        (65536, 26, 128, "bfloat16", False),  # bench_criteo_1hot under bf16
        (65536, 26, 128, "float32", True),  # and under tf32
        (16384, 26, 128, "float32", False),  # strict float32 (tf32x3)
    ]
    return [TuneCase(k, b, f, d, dt, t) for b, f, d, dt, t in shapes for k in ("fwd", "bwd")]


CPU_CASES = [TuneCase("fwd", 4, 3, 8, "float32"), TuneCase("bwd", 4, 3, 8, "float32")]


def configs(case: TuneCase) -> dict[str, KernelConfig]:
    """The default (heuristic) config, then the candidates, by name."""
    from recaccel.ops.interaction.launch_plan import ONE_TILE_MAX_ROWS, KernelConfig, heuristic_plan

    rows = case.fields + 1
    plan = heuristic_plan(rows, case.dim)
    found = {"default": plan.fwd if case.kernel == "fwd" else plan.bwd}
    top_bd = max(16, 1 << (case.dim - 1).bit_length())
    one_tile = rows <= ONE_TILE_MAX_ROWS
    tiles = (plan.bt,) if one_tile else (32, 16, 64)  # the heuristic's 64 last: it is the default
    batch_rows = (1, 2, 4, 8, 16) if one_tile else (1,)
    for bt, block_b, bd, warps in itertools.product(tiles, batch_rows, (16, 32, 64, 128), (2, 4, 8)):
        elements = block_b * bt * max(bt, bd)
        # 16-column chunks only where D needs no more: 8 chunks of a 128-wide row are slow;
        # under 8 elements a thread, warps idle.
        too_narrow = bd > top_bd or (bd == 16 and top_bd > 16)
        if too_narrow or elements > MAX_TILE_ELEMENTS or elements // (32 * warps) < 8:
            continue
        own_bt = 0 if bt == plan.bt else bt  # the table stores a row tile only where it differs
        config = KernelConfig(block_b, bd, warps, own_bt)
        if config not in found.values():
            found[f"b{block_b}{f'_bt{bt}' if own_bt else ''}_bd{bd}_w{warps}"] = config
    return found


def case_bytes(case: TuneCase) -> int:
    """Minimum bytes: the forward reads x [B, R, D] and writes [B, W]; the backward reads
    grad_out and x, and writes grad_x."""
    from recaccel.ops.interaction.reference import interaction_output_dim

    size = torch.empty(0, dtype=getattr(torch, case.dtype)).element_size()
    x = case.batch * (case.fields + 1) * case.dim
    out = case.batch * interaction_output_dim(case.fields, case.dim)
    return size * (x + out if case.kernel == "fwd" else out + 2 * x)


def candidates(case: TuneCase, device: torch.device) -> dict[str, Candidate]:
    """Each config of :func:`configs` as a call on the case's seeded inputs."""
    from recaccel.ops.interaction import triton as kernels
    from recaccel.ops.interaction.reference import interaction_output_dim

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, case.dtype)
    dense = torch.randn(case.batch, case.dim, generator=gen).to(device, dtype)
    pooled = torch.randn(case.batch, case.fields, case.dim, generator=gen).to(device, dtype)
    width = interaction_output_dim(case.fields, case.dim)
    grad = torch.randn(case.batch, width, generator=gen).to(device, dtype)

    def call(config) -> Callable[[], torch.Tensor]:
        if case.kernel == "fwd":
            return lambda: kernels.forward_with(dense, pooled, False, config)
        return lambda: torch.cat([g.flatten() for g in kernels.backward_with(grad, dense, pooled, config)])

    return {name: Candidate(config._asdict(), call(config)) for name, config in configs(case).items()}


def tolerance(case: TuneCase) -> dict[str, float]:
    """Configs sum the column chunks in other orders: float32 rounding, one 16-bit rounding of the output."""
    return {"rtol": 1e-4, "atol": 1e-4} if case.dtype == "float32" else {"rtol": 2.0**-7, "atol": 1e-3}


def sweep_case(
    case: TuneCase, device: torch.device, copy_gbs: float, deadline: float, max_configs: int | None
) -> dict:
    """Checks and times one case's configs until ``deadline``; returns its record."""
    from recaccel.ops.tf32 import tf32

    with tf32(case.tf32):
        cands = candidates(case, device)
        names = list(cands)[:max_configs]
        timed = time_candidates(case.name, cands, names, tolerance=tolerance(case), nbytes=case_bytes(case),
                                copy_gbs=copy_gbs, deadline=deadline, device=device)  # fmt: skip
    return {"case": dataclasses.asdict(case), "name": case.name, "key": table_key(case), **timed}


def table_key(case: TuneCase) -> str:
    """The tuning table's key of a case (the dot mode its dtype and TF32 switch give on CUDA)."""
    from recaccel.ops.interaction import tuning
    from recaccel.ops.interaction.launch_plan import dot_precision

    mode = dot_precision(getattr(torch, case.dtype), on_cuda=True, allow_tf32=case.tf32)
    return tuning.shape_key(case.kernel, case.fields + 1, case.dim, case.dtype, mode)


def winners(records: list[dict]) -> dict[str, dict[str, int]]:
    """Per table key, the config with the least total time relative to each case's best,
    among the configs timed in every case of that key."""

    def fields(figures: dict, _) -> dict[str, int]:
        own = {f: int(figures[f]) for f in ("block_b", "bd", "num_warps")}
        return own | ({"bt": int(figures["bt"])} if figures.get("bt") else {})  # 0: the default row tile

    return pick_winners(records, fields)


def run(
    cases: list[TuneCase], device: torch.device, json_path: Path, budget_s: float, max_configs: int | None
) -> dict:
    """Sweeps ``cases`` in order within ``budget_s``, rewriting ``json_path`` after each."""
    from recaccel.ops.tuning_tables import device_name

    def sweep_one(case: TuneCase, copy_gbs: float, deadline: float) -> dict:
        return sweep_case(case, device, copy_gbs, deadline, max_configs)

    return run_cases(cases, sweep_one, device, device_name(device), json_path, budget_s)


def add_args(parser) -> None:
    """The benchmark's options."""
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    parser.add_argument(
        "--budget-s", type=float, default=150.0, help="whole run's time budget (default %(default)s)"
    )
    parser.add_argument(
        "--json", default="runs/bench/interaction_tune.json", help="results, rewritten after every case"
    )
    parser.add_argument(
        "--write-table", help="merge the winners into this tuning-table module, keyed by device"
    )
    add_output_args(parser, "interaction_tune")


def main(args, command_line: str) -> Path:
    """Runs the sweep; writes the JSON, the markdown and (``--write-table``) the table; returns the markdown."""
    device = resolve_device("interaction_tune", args.device, args.budget_s)
    cuda = device.type == "cuda"
    report = run(
        gpu_cases() if cuda else CPU_CASES, device, Path(args.json), args.budget_s, None if cuda else 2
    )
    from recaccel.ops.interaction import tuning

    return finish(
        report, cuda, args, "Dot interaction launch-config sweep", command_line, winners, tuning.write
    )
