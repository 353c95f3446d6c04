"""``python -m recaccel.cli.rank CONFIG``: one rank of a run that :func:`recaccel.launch`
(``recaccel-train --nproc N``) started under torchrun; not a command to run by hand.

It reads the config file the launcher wrote and calls :func:`recaccel.train`; a failure
is handed to the launcher in one line (:func:`~recaccel.cli.common.handed_to_launcher`),
which reports it once for every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from recaccel.cli.common import run_command, setup_logging

PROG = "recaccel-train"  # the command the user ran: a rank's lines (a clean stop) carry its name


def rank_parser() -> argparse.ArgumentParser:
    """The arguments the launcher gives each rank."""
    parser = argparse.ArgumentParser(prog=PROG, description="One rank of a launched run.")
    parser.add_argument("config", metavar="CONFIG", help="the run's config, written by the launcher")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir")
    parser.add_argument("--overwrite", action="store_true", help="replace the run in train.out_dir")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("--verbose", action="store_true", help="log at INFO level")
    loudness.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def rank_main(argv: Sequence[str] | None = None) -> int:
    """Trains this rank's part of the run; returns its exit status."""
    args = rank_parser().parse_args(argv)
    setup_logging(args.verbose, quiet=args.quiet)

    def body() -> int:
        from recaccel import api
        from recaccel.cli.train import run_flags, third_party_warnings
        from recaccel.config import load_config

        cfg = load_config(args.config, paths_relative_to_file=False)
        resume, overwrite = run_flags(resume=args.resume, overwrite=args.overwrite)
        main_rank = os.environ.get("RANK", "0") == "0"
        with third_party_warnings(verbose=args.verbose, quiet=args.quiet, main_rank=main_rank):
            api.train(cfg, resume=resume, overwrite=overwrite)
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    from recaccel.train.distributed.launch import exit_rank, under_torchrun

    status = rank_main()
    if under_torchrun():
        exit_rank(status)
    sys.exit(status)
