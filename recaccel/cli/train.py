"""recaccel-train: train (or resume) a run from a config."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from recaccel.cli.common import add_config_args, print_metrics, run_command, setup_logging
from recaccel.errors import RecaccelError


def train_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recaccel-train", description="Train and evaluate a model.")
    add_config_args(parser, required=False)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in train.out_dir (its checkpoints, log and metrics are deleted)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="run as N processes on this host through torchrun (with parallel.mode=hybrid)",
    )
    args = parser.parse_args(argv)
    setup_logging(args.verbose)

    def body() -> int:
        import os

        from recaccel import api
        from recaccel.config import load_config

        overrides = list(args.overrides) + (["train.progress=false"] if args.no_progress else [])
        if args.resume and args.overwrite:
            raise RecaccelError(
                "--resume continues the run in RUN_DIR; --overwrite would delete it: pass one"
            )
        if args.nproc is not None:
            from recaccel.preflight import preflight
            from recaccel.train.distributed.launch import check_launch, relaunch, strip_nproc
            from recaccel.train.runlog import check_run_dir

            resolved = Path(args.resume) / "config.toml" if args.resume else args.config
            cfg = load_config(resolved, overrides)
            # Refused here in one line, before any rank starts.
            check_launch(cfg, args.nproc)
            preflight(cfg)
            if not args.resume:
                check_run_dir(Path(cfg.train.out_dir), overwrite=args.overwrite)
            return relaunch(args.nproc, strip_nproc(sys.argv[1:] if argv is None else argv))
        if args.resume:
            metrics = api.resume(args.resume, overrides)
            cfg = load_config(Path(args.resume) / "config.toml")
        else:
            cfg = load_config(args.config, overrides)
            metrics = api.train(cfg, overwrite=args.overwrite)
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 reports
            print_metrics(metrics, Path(cfg.train.out_dir), Path(cfg.data.test).parent)
        return 0

    return run_command("recaccel-train", body)
