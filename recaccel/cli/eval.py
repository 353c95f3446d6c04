"""recaccel-eval: score a checkpoint of a run, optionally writing one prediction per row."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recaccel.cli.common import run_command, setup_logging
from recaccel.errors import RecaccelError

# The run's own record, written by training: an evaluation never replaces it.
RUN_METRICS = "metrics.json"


def eval_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="recaccel-eval",
        description=(
            "Score a run's newest (or --checkpoint STEP) checkpoint on its data.test (or --data) in one "
            "process; a hybrid run's sharded checkpoint is read whole. Prints the metrics and writes "
            "them to RUN_DIR/eval-<step>.json (or --out); the run's metrics.json is never touched."
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
        "--out", metavar="FILE", help="where to write the metrics (default RUN_DIR/eval-<step>.json)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a value of the run's config (repeatable), e.g. --set data.eval_batch_size=4096",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    return run_command("recaccel-eval", lambda: _evaluate(args))


def _evaluate(args: argparse.Namespace) -> int:
    from recaccel import api
    from recaccel.train.eval_checkpoint import checkpoint_step, pick_checkpoint

    run_dir = Path(args.run_dir)
    step = checkpoint_step(pick_checkpoint(run_dir, args.checkpoint))  # one line listing the steps
    out = Path(args.out) if args.out else run_dir / f"eval-{step}.json"
    if out.resolve() == (run_dir / RUN_METRICS).resolve():
        raise RecaccelError(f"--out {out} is the run's own {RUN_METRICS}; write the evaluation elsewhere")
    cfg = api.run_config(run_dir, args.overrides)
    metrics = api.evaluate(cfg, args.data, checkpoint=step, predictions=args.predictions)
    record = {**metrics, "run": str(run_dir), "data": str(args.data or cfg.data.test)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=_json_value) + "\n")
    _print(metrics)
    print(f"metrics written to {out}")
    if args.predictions:
        print(f"predictions written to {metrics['predictions']}")
    return 0


def _json_value(value: Any) -> Any:
    return float(value) if isinstance(value, (int, float)) else str(value)


def _print(metrics: dict[str, Any]) -> None:
    """Numbers one per line, sorted by name (NaN where a metric is undefined)."""
    shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    width = max(len(k) for k in shown)
    for key in sorted(shown):
        value = shown[key]
        text = f"{value:.5f}" if isinstance(value, float) and not math.isnan(value) else str(value)
        print(f"{key:<{width}}  {text}")
