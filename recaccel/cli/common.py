"""What every console entry point shares: one-line errors, logging, config arguments,
the metrics summary."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recaccel.errors import RecaccelError


def run_command(prog: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except (RecaccelError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        if not handed_to_launcher(e):
            print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def handed_to_launcher(error: BaseException) -> bool:
    """A rank under torchrun's agent hands its error line to the launcher, which shows it once."""
    from recaccel.train.distributed.launch import report_rank_error

    return report_rank_error(error)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def add_config_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--config",
        action="append",
        required=required,
        metavar="FILE",
        help="TOML config file (see configs/; repeatable: merged left to right); without it, built-in defaults",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable), e.g. --set train.steps=100",
    )


def print_metrics(metrics: dict[str, Any], out_dir: Path, data_dir: Path | None = None) -> None:
    shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) or v is None}
    planted = data_dir / "synth.json" if data_dir is not None else None
    if planted is not None and planted.is_file():
        # Synthetic data: show how far the model is from the planted (Bayes-optimal) one.
        shown["bayes_auc (planted model)"] = json.loads(planted.read_text())["report"]["bayes_auc"]
    for state, values in metrics.get("states", {}).items():
        for key in ("mae", "rmse", "auc", "gauc", "ndcg@1", "ndcg@3", "mae_no_adapt", "ndcg@3_no_adapt"):
            if key in values:
                shown[f"{state}.{key}"] = values[key]
    width = max(len(k) for k in shown)
    for key in sorted(shown):
        value = shown[key]
        text = f"{value:.5f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {text}")
    print(f"metrics written to {out_dir / 'metrics.json'}")
