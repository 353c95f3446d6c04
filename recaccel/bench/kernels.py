"""``recaccel-bench kernels``: the Triton embedding kernels' config sweep, sized for a short GPU loan.

One command on a lent H100/H200, under 6 minutes (``--budget-s`` 330 by default)::

    T=recaccel/ops/embedding/triton/tuning_table.py
    recaccel-bench kernels --json $OUT/kernels.json --out $OUT/kernels.md --write-table $T
    cp $T $OUT/   # commit it with the JSON

Per case (forward: D 16..256, L 1 / 20 / variable / Zipf, fp32 and bf16, T=26 B=16384 and
65536, T=500 B=4096 D=32; backward + fused row-wise Adagrad update: the same shapes with
Zipf hot rows), most important first, it builds the seeded batch, runs the kernel's
default config (its heuristic, :func:`~recaccel.ops.embedding.triton.forward.forward_config`
/ :func:`~recaccel.ops.embedding.triton.backward.tile_config` without a device), then for
each candidate config: one warm-up call (compiles it), its output checked against the
default's (a config whose output differs, or that fails to compile, is dropped, not
timed), and the launch alone timed with ``triton.testing.do_bench``. Figures are GB/s
in the embedding benchmark's byte accounting and % of the device-to-device copy bandwidth
measured in the same run. The JSON is rewritten after every case, so a run cut short keeps
what it measured; when the budget runs out, the case in progress stops timing and the
remaining cases are listed as skipped. ``--write-table PATH`` merges each shape key's
winner into a generated table module (the package's is
``recaccel/ops/embedding/triton/tuning_table.py``), keyed by the device name, which the
kernels read at launch. ``--device cpu`` runs 2 tiny cases of 2 configs each under the
Triton interpreter (a check that everything runs; its times mean nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from recaccel.bench.common import (
    add_output_args,
    environment_info,
    measure_copy_bandwidth,
    write_results_markdown,
)
from recaccel.bench.embedding_cases import state_floats_per_row
from recaccel.errors import RecaccelError
from recaccel.sparse import SparseFeatures

log = logging.getLogger(__name__)

# A case is not started with less than this left: building its batch and compiling its
# first configs can take that long, and the run must end within the budget plus startup.
CASE_RESERVE_S = 15.0
OPTIMIZER = "rowwise_adagrad"  # the fused update the sweep times (the presets' sparse optimizer)
_ROUNDING_SEED = 12345


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One shape: T tables of R rows, B bags each of L ids (0: uniform 0..40), ids uniform or Zipf.

    Attributes:
        kernel: ``"forward"`` or ``"backward"`` (backward + fused update).
        tables: T.
        batch: B.
        dim: D.
        length: Ids per bag; 0 for lengths uniform in 0..40.
        dtype: Row dtype name (``float32``, ``bfloat16``).
        zipf: Ids Zipf-distributed (hot rows) instead of uniform.
        rows: R, rows per table.
    """

    kernel: str
    tables: int
    batch: int
    dim: int
    length: int
    dtype: str
    zipf: bool = False
    rows: int = 20000

    @property
    def name(self) -> str:
        length = "var" if self.length == 0 else self.length
        ids = "_zipf" if self.zipf else ""
        kernel = {"forward": "fwd", "backward": "bwd"}[self.kernel]
        return f"{kernel}_T{self.tables}_B{self.batch}_D{self.dim}_L{length}{ids}_{self.dtype}"

    @property
    def mean_len(self) -> float:
        return self.length if self.length else 20.0


def _cases(kernel: str, zipf_backward: bool) -> list[KernelCase]:
    """The sweep's shapes for one kernel, most important first (the gpu-check cases lead)."""
    z = zipf_backward and kernel == "backward"
    k = kernel
    return [
        KernelCase(k, 26, 16384, 128, 1, "float32", z),
        KernelCase(k, 26, 16384, 128, 20, "float32", z),
        KernelCase(k, 26, 65536, 128, 1, "float32", z),
        KernelCase(k, 26, 16384, 128, 1, "bfloat16", z),
        KernelCase(k, 26, 16384, 128, 20, "bfloat16", z),
        KernelCase(k, 500, 4096, 32, 1, "float32", z, rows=2000),
        KernelCase(k, 26, 16384, 64, 20, "float32", z),
        KernelCase(k, 26, 16384, 256, 20, "float32", z),
        KernelCase(k, 26, 16384, 16, 20, "float32", z),
        KernelCase(k, 26, 16384, 32, 0, "float32", z),
        KernelCase(k, 26, 16384, 128, 20, "float32", not z),
        KernelCase(k, 26, 65536, 128, 20, "bfloat16", z),
    ]


def gpu_cases() -> list[KernelCase]:
    """Forward and backward cases interleaved, so a run cut short has the leading ones of both."""
    fwd, bwd = _cases("forward", False), _cases("backward", True)
    return [case for pair in zip(fwd, bwd, strict=True) for case in pair]


CPU_CASES = [
    KernelCase("forward", 2, 8, 16, 0, "float32", rows=50),
    KernelCase("backward", 2, 8, 16, 3, "float32", zipf=True, rows=50),
]


@dataclasses.dataclass
class Candidate:
    """One config of a case: its fields and the call that runs it once.

    Attributes:
        fields: The config's integer fields (what the tuning table stores).
        run: Runs the kernel once with this config and returns its output to compare.
        timed: What is timed, when not ``run`` (e.g. the update in place, without copies).
    """

    fields: dict[str, int]
    run: Callable[[], torch.Tensor]
    timed: Callable[[], object] | None = None


# --------------------------------------------------------------------------- data


def _zipf_ids(rows: int, count: int, gen: torch.Generator, alpha: float = 1.05) -> torch.Tensor:
    """``count`` ids in 0..rows-1, row ``k`` with weight ``1/(k+1)^alpha`` (inverse CDF)."""
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** alpha
    cdf = torch.cumsum(p / p.sum(), 0)
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    return torch.searchsorted(cdf, u).clamp_(max=rows - 1)


def make_batch(case: KernelCase, device: torch.device, seed: int = 0):
    """(weight [T*R, D], batch, local features) of a case, seeded."""
    from recaccel.ops.embedding.packing import LocalFeatures

    gen = torch.Generator().manual_seed(seed)
    bags = case.tables * case.batch
    if case.length:
        lengths = torch.full((bags,), case.length, dtype=torch.int64)
    else:
        lengths = torch.randint(0, 41, (bags,), generator=gen)
    count = int(lengths.sum())
    if case.zipf:
        ids = _zipf_ids(case.rows, count, gen)
    else:
        ids = torch.randint(0, case.rows, (count,), generator=gen)
    keys = [f"t{i}" for i in range(case.tables)]
    sf = SparseFeatures.from_lengths(keys, ids, lengths).to(device)
    weight = torch.randn(case.tables * case.rows, case.dim, generator=gen).to(
        device, getattr(torch, case.dtype)
    )
    offsets = [t * case.rows for t in range(case.tables)]
    local = LocalFeatures.build(list(range(case.tables)), offsets, [False] * case.tables, case.tables, device)
    return weight, sf, local


# --------------------------------------------------------------------------- configs


def forward_sweep(case: KernelCase) -> list[dict[str, int]]:
    """BLOCK_BAGS x warps x UNROLL within the tile kernel's register budget (UNROLL 1 for L=1).

    At most 128 sum and in-flight row values per thread: sm90_report compiles BLOCK_BAGS 64,
    D 128, UNROLL 1, 4 warps (128) to 237 registers without spills, UNROLL 2 at 2 warps
    (384) to 255 registers and 852 bytes of spill stores.
    """
    from recaccel.ops.embedding.triton.forward import forward_config

    block_d = 1 << (case.dim - 1).bit_length()
    long_threshold = forward_config(case.dim, case.mean_len, getattr(torch, case.dtype)).long_threshold
    unrolls = (1,) if case.length == 1 else (1, 2, 4)
    return [
        {"block_bags": bb, "num_warps": w, "unroll": u, "long_threshold": long_threshold}
        for bb in (16, 32, 64, 128)
        for w in (2, 4, 8)
        for u in unrolls
        if bb * block_d <= 8192 and bb * block_d * u <= 16384 and bb * block_d * (1 + u) <= 128 * 32 * w
    ]


def backward_sweep(case: KernelCase) -> list[dict[str, int]]:
    """BLOCK_OCC x warps with a 512..4096-value tile and at most 32 values per thread (a
    value, its scan flag and the scan's temporaries: 4096 at 4 warps takes 191-255 registers)."""
    block_d = 1 << (case.dim - 1).bit_length()
    return [
        {"block_occ": occ, "num_warps": w}
        for occ in (8, 16, 32, 64, 128, 256)
        for w in (2, 4, 8)
        if (512 <= occ * block_d <= 4096 and occ * block_d <= 32 * 32 * w)
        or (occ == 8 and occ * block_d > 4096)
    ]


def forward_candidates(case: KernelCase, device: torch.device) -> tuple[dict[str, Candidate], int]:
    """The forward's default (first) and swept configs, and the case's bytes moved."""
    from recaccel.ops.embedding.triton.forward import ForwardConfig, embedding_bag_forward, forward_config

    weight, sf, local = make_batch(case, device)
    out = torch.empty(case.batch, case.tables, case.dim, device=device)
    default = dataclasses.asdict(forward_config(case.dim, case.mean_len, weight.dtype))

    def candidate(fields: dict[str, int]) -> Candidate:
        config = ForwardConfig(**fields)
        return Candidate(
            fields, lambda: embedding_bag_forward(weight, sf, local, case.batch, out=out, config=config)
        )

    configs = {"default": candidate(default)}
    configs.update({_name(f): candidate(f) for f in forward_sweep(case) if f != default})
    num_ids, bags = sf.values.numel(), case.tables * case.batch
    nbytes = num_ids * case.dim * weight.element_size() + num_ids * 8 + (bags + 1) * 8 + bags * case.dim * 4
    return configs, nbytes


def backward_candidates(case: KernelCase, device: torch.device) -> tuple[dict[str, Candidate], int]:
    """The occurrence-tile update's default (first) and swept configs, and the bytes moved.

    Each candidate's check run updates a fresh copy of the same initial state and returns
    the updated rows and Adagrad state; timing repeats the kernels alone on another copy.
    """
    from recaccel.ops.embedding.optimizers import init_states
    from recaccel.ops.embedding.packing import gather_pack_ids
    from recaccel.ops.embedding.row_groups import group_by_row
    from recaccel.ops.embedding.specs import SparseOptimConfig
    from recaccel.ops.embedding.triton.backward import _launch_tiles, tile_config

    weight, sf, local = make_batch(case, device)
    ids = gather_pack_ids(sf, local, case.batch, with_bags=True)
    order = group_by_row(ids.rows).order
    keys, bags = ids.rows.index_select(0, order), ids.bags.index_select(0, order)
    grad_out = torch.randn(case.batch, case.tables, case.dim, generator=torch.Generator().manual_seed(1)).to(
        device
    )
    momentum = init_states(OPTIMIZER, weight.shape[0], case.dim, device)["momentum1"]
    optim = SparseOptimConfig(lr=0.01, eps=1e-8)
    hyper = (optim.lr, optim.eps, optim.beta1, optim.beta2, 1 - optim.beta1, 1 - optim.beta2, 0.0, 1.0, 1.0)
    stochastic_seed = _ROUNDING_SEED if weight.dtype != torch.float32 else 0

    def update(w: torch.Tensor, m: torch.Tensor, fields: dict[str, int]) -> None:
        _launch_tiles(
            w, m, m, keys, bags, None, grad_out, case.batch, 1, hyper, stochastic_seed,
            fields["block_occ"], fields["num_warps"],
        )  # fmt: skip

    def candidate(fields: dict[str, int]) -> Candidate:
        def run() -> torch.Tensor:
            w, m = weight.clone(), momentum.clone()
            update(w, m, fields)
            return torch.cat([w.float().flatten(), m])

        return Candidate(fields, run)

    occ, warps = tile_config(case.dim)
    default = {"block_occ": occ, "num_warps": warps}
    configs = {"default": candidate(default)}
    configs.update({_name(f): candidate(f) for f in backward_sweep(case) if f != default})
    timed_w, timed_m = weight.clone(), momentum.clone()
    for c in configs.values():  # timing updates one copy in place: no clone inside the timed call
        c.timed = lambda f=c.fields: update(timed_w, timed_m, f)
    unique = int(torch.unique(keys).numel())
    index_bytes = keys.numel() * 8 + (case.tables * case.batch + 1) * 8
    row_bytes = case.dim * weight.element_size() + state_floats_per_row(OPTIMIZER, case.dim) * 4
    nbytes = case.batch * case.tables * case.dim * 4 + index_bytes + 2 * unique * row_bytes
    return configs, nbytes


def _name(fields: dict[str, int]) -> str:
    short = {"block_bags": "bb", "num_warps": "w", "unroll": "u", "block_occ": "occ"}
    return "_".join(f"{short[k]}{v}" for k, v in fields.items() if k in short)


def _tolerance(case: KernelCase) -> dict[str, float]:
    """Configs sum in different orders: float32 rounding, plus one stochastic-rounding step of 16-bit rows."""
    if case.dtype == "float32":
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 2.0**-7, "atol": 1e-4}


# --------------------------------------------------------------------------- timing


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA (L2 flushed between calls), one call elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def sweep_case(
    case: KernelCase,
    device: torch.device,
    copy_gbs: float,
    deadline: float,
    max_configs: int | None = None,
    extra: dict[str, Candidate] | None = None,
) -> dict:
    """Checks and times the configs of one case until ``deadline`` (``time.monotonic``).

    Args:
        case: The shape.
        device: Where it runs.
        copy_gbs: The copy bandwidth of this run (the % column).
        deadline: Stop timing further configs after this instant (the case is then ``truncated``).
        max_configs: Time at most this many configs, the default included (all when None).
        extra: More candidates (name -> Candidate), tried after the default (a test hook).

    Returns:
        The case's record: its shape, bytes, each timed config's figures, dropped configs
        with the reason, the best config's name.
    """
    build = forward_candidates if case.kernel == "forward" else backward_candidates
    candidates, nbytes = build(case, device)
    names = list(candidates)
    if extra:
        candidates.update(extra)
        names = names[:1] + list(extra) + names[1:]
    if max_configs is not None:
        names = names[:max_configs]
    want = candidates["default"].run()
    timed: dict[str, dict] = {}
    dropped: dict[str, str] = {}
    truncated = False
    for name in names:
        if time.monotonic() > deadline:
            truncated = True
            break
        reason = _check(candidates[name], want, case)
        if reason is not None:
            dropped[name] = reason
            log.info("%s: dropped %s: %s", case.name, name, reason)
            continue
        c = candidates[name]
        ms = _time_ms(c.timed or c.run, device)
        gb_s = nbytes / (ms * 1e-3) / 1e9
        timed[name] = {"ms": ms, "gb_s": gb_s, "pct_copy": 100 * gb_s / copy_gbs, **c.fields}
    best = min(timed, key=lambda n: timed[n]["ms"]) if timed else None
    if best is not None:
        log.info("%s: default %.1f%% of copy, best %s %.1f%%", case.name,
                 timed.get("default", {}).get("pct_copy", float("nan")), best, timed[best]["pct_copy"])  # fmt: skip
    return {"case": dataclasses.asdict(case), "name": case.name, "bytes": nbytes, "configs": timed,
            "dropped": dropped, "best": best, "truncated": truncated}  # fmt: skip


def _check(candidate: Candidate, want: torch.Tensor, case: KernelCase) -> str | None:
    """None when the config compiles, runs and matches the default's output; else why not."""
    try:
        got = candidate.run()
        torch.testing.assert_close(got, want, **_tolerance(case))
    except Exception as exc:  # a config that fails to compile or run is dropped, not fatal
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


# --------------------------------------------------------------------------- table


def shape_key(case: KernelCase) -> str:
    """The tuning table's key of a case's kernel and shape."""
    from recaccel.ops.embedding.triton import tuning
    from recaccel.ops.embedding.triton.forward import length_bucket

    if case.kernel == "forward":
        return tuning.forward_key(case.dim, length_bucket(case.mean_len), case.dtype)
    return tuning.backward_key(case.dim, case.dtype)


def winners(records: list[dict]) -> dict[str, dict[str, int]]:
    """Per shape key, the config with the least total time relative to each case's best,
    among configs timed in every case of that key."""
    by_key: dict[str, list[dict]] = {}
    for rec in records:
        if rec.get("best"):
            by_key.setdefault(rec["key"], []).append(rec)
    table = {}
    for key, recs in by_key.items():
        common = set.intersection(*(set(r["configs"]) for r in recs))
        if not common:
            continue

        def cost(name: str, recs=recs) -> float:
            return sum(r["configs"][name]["ms"] / r["configs"][r["best"]]["ms"] for r in recs)

        name = min(sorted(common), key=cost)
        table[key] = _fields(recs[0]["configs"][name], recs[0]["case"]["kernel"])
    return table


def _fields(figures: dict, kernel: str) -> dict[str, int]:
    names = (
        ("block_bags", "num_warps", "unroll", "long_threshold")
        if kernel == "forward"
        else ("block_occ", "num_warps")
    )
    return {k: int(figures[k]) for k in names}


# --------------------------------------------------------------------------- CLI


def add_args(parser) -> None:
    """The benchmark's options."""
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if present)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="whole run's time budget (default %(default)s)"
    )
    parser.add_argument(
        "--json", default="runs/bench/kernels.json", help="results file, rewritten after every case"
    )
    parser.add_argument(
        "--write-table", help="merge the winners into this tuning-table module, keyed by device"
    )
    add_output_args(parser, "kernels")


def run_sweep(
    cases: list[KernelCase],
    device: torch.device,
    json_path: Path,
    budget_s: float,
    max_configs: int | None = None,
    extra: dict[str, dict[str, Candidate]] | None = None,
) -> dict:
    """Sweeps ``cases`` in order within ``budget_s``, rewriting ``json_path`` after each case.

    Args:
        cases: The shapes, most important first.
        device: Where to run.
        json_path: The report, rewritten after every case.
        budget_s: Seconds for the whole run; cases left when it is spent are listed as skipped.
        max_configs: Configs per case (all when None).
        extra: case name -> more candidates for that case (a test hook, see :func:`sweep_case`).

    Returns:
        The report (what ``json_path`` holds).
    """
    start = time.monotonic()
    deadline = start + budget_s
    copy_gbs = measure_copy_bandwidth(device)
    report = {"env": environment_info(device), "device_name": _device_key(device), "copy_gb_s": copy_gbs,
              "budget_s": budget_s, "cases": [], "skipped": []}  # fmt: skip
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        if time.monotonic() > deadline - min(CASE_RESERVE_S, budget_s / 4):
            report["skipped"].append(case.name)
        else:
            record = sweep_case(case, device, copy_gbs, deadline, max_configs, (extra or {}).get(case.name))
            record["key"] = shape_key(case)
            report["cases"].append(record)
        report["elapsed_s"] = time.monotonic() - start
        json_path.write_text(json.dumps(report, indent=1))
    return report


def _device_key(device: torch.device) -> str:
    from recaccel.ops.embedding.triton import tuning

    return tuning.device_name(device)


def main(args, command_line: str) -> Path:
    """Runs the sweep; writes the JSON, the markdown and (``--write-table``) the table; returns the markdown."""
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
    elif device.type == "cuda" and not torch.cuda.is_available():
        raise RecaccelError("recaccel-bench kernels: --device cuda, but torch sees no CUDA device")
    elif device.type != "cuda":
        raise RecaccelError(f"recaccel-bench kernels: --device {args.device}: expected cuda or cpu")
    if args.budget_s <= 0:
        raise RecaccelError(f"recaccel-bench kernels: --budget-s {args.budget_s}: must be > 0")
    cuda = device.type == "cuda"
    report = run_sweep(
        gpu_cases() if cuda else CPU_CASES, device, Path(args.json), args.budget_s, None if cuda else 2
    )
    notes = [f"copy bandwidth {report['copy_gb_s']:.0f} GB/s (read + write), measured in this run",
             f"skipped for the budget: {', '.join(report['skipped']) or 'none'}"]  # fmt: skip
    if not cuda:
        notes.append(
            "CPU run under the Triton interpreter: checks the sweep runs; the times say nothing about a GPU"
        )
    if args.write_table:
        from recaccel.ops.embedding.triton import tuning

        path = tuning.write_table(args.write_table, report["device_name"], winners(report["cases"]))
        notes.append(f"winners written to {path} for {report['device_name']}")
    rows = [_summary_row(rec) for rec in report["cases"]]
    return write_results_markdown(
        args.out, "Embedding kernel config sweep", report["env"], command_line, rows, notes
    )


def _summary_row(rec: dict) -> dict:
    default = rec["configs"].get("default", {})
    best = rec["configs"].get(rec["best"], {}) if rec["best"] else {}
    return {
        "case": rec["name"],
        "configs timed": len(rec["configs"]),
        "dropped": len(rec["dropped"]),
        "default % copy": default.get("pct_copy"),
        "best": rec["best"],
        "best ms": best.get("ms"),
        "best GB/s": best.get("gb_s"),
        "best % copy": best.get("pct_copy"),
    }
