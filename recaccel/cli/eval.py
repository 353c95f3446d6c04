"""recaccel-eval: score a checkpoint of a run, optionally writing one prediction per row."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recaccel.cli.common import add_set_arg, format_metric, run_command, setup_logging
from recaccel.output_paths import Read, check_output, run_reads, write_text_atomic


def eval_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="recaccel-eval",
        description=(
            "Score a run's newest (or --checkpoint STEP) checkpoint on its data.test (or --data) in one "
            "process; a hybrid run's sharded checkpoint is read whole. Prints the metrics and writes "
            "them to RUN_DIR/eval-<step>.json (other --data: eval-<step>-<hash>.json, <hash> 8 hex digits of "
            "the SHA-256 of the data's absolute path; or --out); the run's metrics.json is never touched. An "
            "existing --out / --predictions file is refused unless --force; the run's own files and the "
            "data it reads are never replaced."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (train.out_dir of a run)")
    parser.add_argument("--data", metavar="PATH", help="Parquet file or folder to score (default: data.test)")
    parser.add_argument(
        "--checkpoint", type=int, metavar="STEP", help="the checkpoint's step (default: newest)"
    )
    parser.add_argument(
        "--predictions",
        metavar="OUT.parquet",
        help="write one row per evaluation row: prediction (probability for BCE, rating for MSE), label, "
        "weight if any, and for meta runs task and query (support rows: null prediction)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="where to write the metrics (default RUN_DIR/eval-<step>.json, or eval-<step>-<hash>.json for other "
        "--data)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out / --predictions file (never the run's own files or the data read)",
    )
    add_set_arg(
        parser, "override a value of the run's config (repeatable), e.g. --set data.eval_batch_size=4096"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    return run_command("recaccel-eval", lambda: _evaluate(args))


def _evaluate(args: argparse.Namespace) -> int:
    from recaccel import api
    from recaccel.train.evaluation.from_checkpoint import checkpoint_step, eval_file_name, pick_checkpoint

    run_dir = Path(args.run_dir)
    chosen = pick_checkpoint(run_dir, args.checkpoint)  # one line listing the steps
    step = checkpoint_step(chosen)
    cfg = api.run_config(run_dir, args.overrides)
    default = run_dir / eval_file_name(step, args.data or cfg.data.test, cfg.data.test)
    out = _check_outputs(args, run_dir, chosen, cfg, default)  # before the evaluation, not after it
    metrics = api.evaluate(cfg, args.data, checkpoint=step, predictions=args.predictions)
    record = {**metrics, "run": str(run_dir), "data": str(args.data or cfg.data.test)}
    write_text_atomic(out, json.dumps(record, indent=2, default=_json_value) + "\n")
    _print(metrics)
    print(f"metrics written to {out}")
    if args.predictions:
        print(f"predictions written to {metrics['predictions']}")
    return 0


def _check_outputs(
    args: argparse.Namespace, run_dir: Path, checkpoint: Path, cfg: Any, default: Path
) -> Path:
    """The metrics file, once it and ``--predictions`` are known to replace neither an
    input (the run's own files, the checkpoint, the data) nor, without --force, a file.

    Raises:
        OutputError: one line naming the flag and the path.
    """
    from recaccel.train.run.runlog import RUN_FILES

    reads = [
        *run_reads(run_dir, RUN_FILES),
        Read(checkpoint, "the checkpoint this command reads"),
        Read(Path(args.data or cfg.data.test), "the data this command reads"),
        Read(Path(cfg.data.train), "the run's training data"),
    ]
    flag = "--out" if args.out else "the metrics file"
    out = check_output(args.out or default, flag=flag, force=args.force, reads=reads)
    if args.predictions:
        reads.append(Read(out, "the metrics file this command writes"))
        check_output(args.predictions, flag="--predictions", force=args.force, reads=reads)
    return out


def _json_value(value: Any) -> Any:
    return float(value) if isinstance(value, (int, float)) else str(value)


def _print(metrics: dict[str, Any]) -> None:
    """Numbers one per line, sorted by name, counts as integers (NaN where a metric is undefined)."""
    shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    width = max(len(k) for k in shown)
    for key in sorted(shown):
        print(f"{key:<{width}}  {format_metric(key, shown[key])}")
