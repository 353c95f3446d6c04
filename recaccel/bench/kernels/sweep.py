"""``recaccel-bench kernels``: the Triton embedding kernels' config sweep, sized for a short GPU loan.

One command on a lent H100/H200, under 6 minutes (``--budget-s`` 330 by default)::

    T=recaccel/ops/embedding/triton/tuning_table.py
    recaccel-bench kernels --json $OUT/kernels.json --out $OUT/kernels.md --write-table $T
    cp $T $OUT/   # commit it with the JSON

Per case (forward: D 16..256, L 1 / 20 / variable / Zipf, fp32 and bf16, T=26 B=16384 and
65536, T=500 B=4096 D=32; backward + fused row-wise Adagrad update: the same shapes with
Zipf hot rows; one-chunk tiles, then programs walking 4 and 16 chunks around the device's
tuned entry), most important first, it builds the seeded batch, runs the kernel's
default config (its heuristic, :func:`~recaccel.ops.embedding.triton.forward.forward_config`
/ :func:`~recaccel.ops.embedding.triton.backward.tile_config` without a device), compiles
every candidate config at once on a thread pool (:func:`precompile`, CUDA only), then for
each candidate config: its output checked against the default's (a config whose output
differs, or that fails to compile, is dropped, not timed), and the launch alone timed with ``triton.testing.do_bench``. Figures are GB/s
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
from pathlib import Path

import torch

from recaccel.bench.harness.report import add_output_args
from recaccel.bench.kernels.config_sweep import (
    check_candidate,
    compile_workers,
    finish,
    pick_winners,
    precompile,
    resolve_device,
    run_cases,
    time_candidates,
)
from recaccel.bench.kernels.sweep_cases import (
    CPU_CASES,
    Candidate,
    KernelCase,
    backward_candidates,
    forward_candidates,
    gpu_cases,
)

__all__ = ["compile_workers", "precompile", "run_sweep", "sweep_case", "winners"]


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- configs


def _tolerance(case: KernelCase) -> dict[str, float]:
    """Configs sum in different orders: float32 rounding, plus one stochastic-rounding step of 16-bit rows."""
    if case.dtype == "float32":
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 2.0**-7, "atol": 1e-4}


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
    timed = time_candidates(case.name, candidates, names, tolerance=_tolerance(case), nbytes=nbytes,
                            copy_gbs=copy_gbs, deadline=deadline, device=device)  # fmt: skip
    return {"case": dataclasses.asdict(case), "name": case.name, **timed}


def _check(candidate: Candidate, want: torch.Tensor, case: KernelCase) -> str | None:
    """None when the config compiles, runs and matches the default's output; else why not."""
    return check_candidate(candidate, want, _tolerance(case))


# --------------------------------------------------------------------------- table


def shape_key(case: KernelCase) -> str:
    """The tuning table's key of a case's kernel and shape."""
    from recaccel.ops.embedding.triton import tuning
    from recaccel.ops.embedding.triton.forward import length_bucket

    if case.kernel == "forward":
        return tuning.forward_key(case.dim, length_bucket(case.mean_len), case.dtype)
    return tuning.backward_key(case.dim, case.dtype, case.density)


def winners(records: list[dict]) -> dict[str, dict[str, int]]:
    """Per shape key, the config with the least total time relative to each case's best,
    among configs timed in every case of that key; the backward's cases also count, all
    buckets together, for their key without the density bucket (what a launch without a
    bucket reads: autograd mode, and a bucket no case covered)."""
    from recaccel.ops.embedding.triton import tuning

    bucketless = [
        {**rec, "key": tuning.backward_key(rec["case"]["dim"], rec["case"]["dtype"])}
        for rec in records
        if rec["case"]["kernel"] == "backward" and "dim" in rec["case"]
    ]
    return pick_winners(records + bucketless, lambda figures, rec: _fields(figures, rec["case"]["kernel"]))


def _fields(figures: dict, kernel: str) -> dict[str, int]:
    """A winner's table entry; a backward one has ``subtiles`` only when above 1 (absent: 1)."""
    if kernel == "forward":
        return {k: int(figures[k]) for k in ("block_bags", "num_warps", "unroll", "long_threshold")}
    if "piece_len" in figures:
        return {k: int(figures[k]) for k in ("piece_len", "block_pieces", "unroll", "num_warps")}
    entry = {k: int(figures[k]) for k in ("block_occ", "num_warps")}
    if int(figures.get("subtiles", 1)) != 1:
        entry["subtiles"] = int(figures["subtiles"])
    return entry


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
    extra = extra or {}

    def sweep_one(case: KernelCase, copy_gbs: float, deadline: float) -> dict:
        record = sweep_case(case, device, copy_gbs, deadline, max_configs, extra.get(case.name))
        return {**record, "key": shape_key(case)}

    return run_cases(cases, sweep_one, device, _device_key(device), json_path, budget_s)


def _device_key(device: torch.device) -> str:
    from recaccel.ops.embedding.triton import tuning

    return tuning.device_name(device)


def main(args, command_line: str) -> Path:
    """Runs the sweep; writes the JSON, the markdown and (``--write-table``) the table; returns the markdown."""
    device = resolve_device("kernels", args.device, args.budget_s)
    cuda = device.type == "cuda"
    report = run_sweep(
        gpu_cases() if cuda else CPU_CASES, device, Path(args.json), args.budget_s, None if cuda else 2
    )
    from recaccel.ops.embedding.triton import tuning

    return finish(
        report, cuda, args, "Embedding kernel config sweep", command_line, winners, tuning.write_table
    )
