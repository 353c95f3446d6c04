"""Benchmark: packed embedding bag (reference, Triton, FBGEMM) vs the per-table ``nn.EmbeddingBag`` loop.

``recaccel-bench embedding`` sweeps T in {1, 10, 100, 1000} for each (B, D, L) shape
(defaults by device, below), plus single extra cases, and writes a markdown summary,
optionally JSON, and a PNG of speedup vs T. How candidates are built and checked:
:mod:`recaccel.bench.kernels.embedding_cases`; how they are timed:
:mod:`recaccel.bench.kernels.embedding_run`.

Defaults: CPU shapes B:D:L = 512:16:1 and 2048:32:1; CUDA adds the case
T:B:D:L = 100:16384:128:20. Rows per table:
:func:`recaccel.bench.kernels.embedding_cases.default_rows`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from recaccel.bench.harness.report import add_output_args, plot_file, write_results_markdown
from recaccel.bench.kernels.embedding_cases import (
    BASELINE_OPTIMIZERS,
    ID_DISTRIBUTIONS,
    LENGTHS,
    EmbeddingCase,
    default_factories,
    default_rows,
)
from recaccel.bench.kernels.embedding_run import run_embedding_bench
from recaccel.bench.kernels.kernel_breakdown import breakdown_path
from recaccel.errors import ConfigError

__all__ = ["add_args", "default_cases", "main", "run_embedding_bench", "write_markdown_summary"]

DEFAULT_TABLES = (1, 10, 100, 1000)
DEFAULT_SHAPES = {"cpu": ("512:16:1", "2048:32:1"), "cuda": ("512:16:1", "2048:32:1")}
DEFAULT_EXTRA = {"cpu": (), "cuda": ("100:16384:128:20",)}


def _parse(text: str, fields: int, what: str) -> tuple[int, ...]:
    parts = text.split(":")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != fields:
        raise ConfigError(f"embedding bench: {what} must be {fields} integers joined by ':', got {text!r}")
    return values


def default_cases(
    device: torch.device | str,
    tables: Sequence[int] = DEFAULT_TABLES,
    shapes: Sequence[str] | None = None,
    extra: Sequence[str] | None = None,
    rows: int | None = None,
    **case_options,
) -> list[EmbeddingCase]:
    """The sweep: every T of ``tables`` for each ``"B:D:L"`` shape, then each ``"T:B:D:L"`` extra case.

    Args:
        device: Picks the default shapes, extra cases and rows.
        tables: T values of the sweep.
        shapes: ``"B:D:L"`` strings (default by device type).
        extra: ``"T:B:D:L"`` strings (default by device type).
        rows: R per table (default :func:`default_rows` per case).
        **case_options: Other :class:`EmbeddingCase` fields (ids, lengths, optimizer, ...).
    """
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    shapes = DEFAULT_SHAPES[kind] if shapes is None else shapes
    extra = DEFAULT_EXTRA[kind] if extra is None else extra
    specs = [(t, *_parse(s, 3, "a shape B:D:L")) for s in shapes for t in tables]
    specs += [_parse(s, 4, "a case T:B:D:L") for s in extra]
    seen, out = set(), []
    for t, b, d, l in specs:
        if (t, b, d, l) in seen:
            continue
        seen.add((t, b, d, l))
        r = rows if rows is not None else default_rows(torch.device(device), t, d)
        out.append(EmbeddingCase(tables=t, batch=b, dim=d, bag_len=l, rows=r, **case_options))
    return out


def write_markdown_summary(result: dict, path: str | Path, command: str, notes: Sequence[str] = ()) -> Path:
    """Writes ``result`` (from :func:`run_embedding_bench`) as markdown: device, versions, date, command."""
    cases = result["cases"]
    first = cases[0] if cases else {}
    text = [
        "Each row: median ms per candidate over the repeats (candidates interleaved within every repeat, "
        "order rotating), `<name>_x` = per_table ms / <name> ms.",
        (
            "per_table = recaccel.models.embedding.PerTableEmbeddingBag (one nn.EmbeddingBag per table, "
            "sparse=True, looked up in a Python loop, with its per-table id check and field slicing, which "
            "on CUDA synchronise with the host per table) + "
            f"{BASELINE_OPTIMIZERS.get(first.get('optimizer'), 'a torch optimizer')}: zero_grad, "
            "backward, step. reference / triton / fbgemm = recaccel.ops.embedding.PackedEmbeddingBag("
            "backend=..., mode='fused', bounds_check='auto' as the models build it: deferred into "
            "triton's kernels, eager elsewhere): one lookup per pack, the sparse optimizer applied inside backward."
        ),
        (
            "forward = lookup under torch.no_grad(); fwd+bwd+update = lookup, backward of sum(pooled * G) "
            "with a fixed random G [B, T, D], optimizer update. K batches per case, repeat k of every "
            "candidate reads batch k % K."
        ),
        (
            "Checked before timing, on the benchmark's inputs: every candidate's forward equals the "
            "reference's (torch.testing.assert_close), and so does its forward after one train step when "
            "its update rule is the reference's."
        ),
        (
            "MB_moved (and GB/s on CUDA): forward = N*D*4 (each id's row) + N*8 + (T*B+1)*8 (ids, offsets) "
            "+ B*T*D*4 (output); backward+update adds B*T*D*4 (output grad) + the ids and offsets again + "
            "2*U*(D + S)*4 (read and write each distinct touched row and its S optimizer floats: 0 SGD, 1 "
            "row-wise Adagrad, 2D Adam). FBGEMM's benchmark counts forward as B*T*L*D + B*T*D elements "
            "(no ids) and fwd+bwd as 3x that. bw_frac = GB/s / the device-to-device copy bandwidth "
            "(read + write) measured in the same run."
        ),
    ]
    if first:
        text.append(
            f"Inputs: ids {first['ids']}"
            + (f" (alpha {first['zipf_alpha']})" if first["ids"] == "zipf" else "")
            + f", {first['lengths']} bag lengths, optimizer {first['optimizer']}, lr {first['lr']}, "
            "float32 rows."
        )
    if result.get("copy_GBps") is not None:
        text.append(f"Copy bandwidth measured in this run: {result['copy_GBps']:.1f} GB/s.")
    text += [f"Skipped {name}: {why}" for name, why in result.get("skipped", {}).items()]
    for t in result.get("targets", []):
        verdict = "met" if t["met"] else "NOT met"
        text.append(f"Target {t['target']}: {t['candidate']} {t['speedup']:.2f}x, {verdict}.")
    text += list(notes)
    return write_results_markdown(
        path,
        "Packed embedding bag vs per-table nn.EmbeddingBag loop",
        result["env"],
        command,
        result["results"],
        text,
    )


def add_args(parser) -> None:
    """``recaccel-bench embedding`` options."""
    parser.add_argument("--tables", type=int, nargs="+", default=list(DEFAULT_TABLES), help="T values swept")
    parser.add_argument(
        "--shapes", nargs="+", metavar="B:D:L", help="shapes swept over --tables (default by device)"
    )
    parser.add_argument("--cases", nargs="*", metavar="T:B:D:L", help="extra single cases (by device)")
    parser.add_argument("--rows", type=int, help="rows per table (10k CPU / 100k CUDA, memory-capped)")
    parser.add_argument("--ids", choices=ID_DISTRIBUTIONS, default="uniform", help="id distribution per bag")
    parser.add_argument("--zipf-alpha", type=float, default=1.05, help="skew of --ids zipf")
    parser.add_argument("--lengths", choices=LENGTHS, default="fixed", help="fixed L, or uniform in 0..2L")
    parser.add_argument(
        "--optimizer", choices=tuple(BASELINE_OPTIMIZERS), default="sgd", help="fused sparse optimizer"
    )
    parser.add_argument("--lr", type=float, default=0.01, help="its learning rate")
    parser.add_argument("--repeats", type=int, help="timed calls per candidate and mode (20 CPU, 100 CUDA)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per candidate and mode")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches per case, cycled")
    parser.add_argument("--with-autograd", action="store_true", help="also time the packed autograd mode")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the packed candidates (on CUDA: triton) of every case after timing them: per-kernel device time "
        "and host ms per iteration in <out stem>_kernels.md, host ops in <out stem>_host.txt",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if present)",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the generated ids and tables")
    parser.add_argument("--note", action="append", default=[], help="free text for the notes (repeatable)")
    parser.add_argument("--json", help="write machine-readable results here")
    add_output_args(parser, "embedding", plot="speedup vs T")


def main(args, command_line: str) -> Path:
    """Runs the sweep from parsed ``args`` and writes the markdown summary; returns its path."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cases = default_cases(
        device,
        args.tables,
        args.shapes,
        args.cases,
        args.rows,
        ids=args.ids,
        zipf_alpha=args.zipf_alpha,
        lengths=args.lengths,
        optimizer=args.optimizer,
        lr=args.lr,
    )
    repeats = args.repeats if args.repeats is not None else (100 if device.type == "cuda" else 20)
    load_before = os.getloadavg()[0]

    def write(result: dict) -> Path:
        notes = [
            f"threads: {torch.get_num_threads()}; repeats {repeats}, warmup {args.warmup}, {args.batches} batches",
            # Other jobs on the host skew CPU times; the load says how busy it was.
            f"host load average (1 min) before / after the run: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
            f"on {os.cpu_count()} CPUs",
        ]
        if result.get("profile"):
            notes.append(result["profile"])
        return write_markdown_summary(result, args.out, command_line, notes + list(args.note))

    result = run_embedding_bench(
        cases,
        device,
        repeats,
        warmup=args.warmup,
        num_batches=args.batches,
        json_path=args.json,
        plot_path=plot_file(args),
        factories=default_factories(args.seed, with_autograd=args.with_autograd),
        seed=args.seed,
        profile_path=breakdown_path(args.out) if args.profile else None,
        on_case=write,  # a run killed at its budget keeps the markdown of the cases done
    )
    return write(result)
