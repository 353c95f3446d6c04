"""recaccel-train: train (or resume) a run from a config."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recaccel.cli.common import add_config_args, print_metrics, run_command, setup_logging
from recaccel.errors import RecaccelError

if TYPE_CHECKING:
    from recaccel.config import Config


def train_parser() -> argparse.ArgumentParser:
    """The arguments of recaccel-train; ``--help`` ends with every config key
    (:mod:`recaccel.config.help`)."""
    from recaccel import __version__
    from recaccel.config.help import config_reference, config_rules

    parser = argparse.ArgumentParser(
        prog="recaccel-train",
        description="Train and evaluate a model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"{config_rules()}\n\nconfig keys, by [section]: key = default  (type), what it does\n\n"
        + config_reference(),
    )
    add_config_args(parser, required=False)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in train.out_dir (the files recaccel wrote there are deleted: "
        "config, log, metrics, checkpoints, eval-*.json, TensorBoard events; other files stay)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (defaults included) as TOML and exit",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress bars (evaluation, restart and monitor lines and the final metrics still print)",
    )
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level; at each log step print the time per step (data wait, step) and the data "
        "counters (rows read, skipped, bad ids); show third-party warnings",
    )
    loudness.add_argument(
        "-q", "--quiet", action="store_true", help="print only one final line (the main metrics), no bar"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="run as N processes on this host through torchrun (with parallel.mode=hybrid)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc: after a rank fails, restart every rank up to K times, resuming "
        "from the newest checkpoint (default 0: the run fails)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def train_main(argv: Sequence[str] | None = None) -> int:
    args = train_parser().parse_args(argv)
    setup_logging(args.verbose, quiet=args.quiet)

    def body() -> int:
        from recaccel import api
        from recaccel.config import config_to_toml, load_config
        from recaccel.preflight import preflight

        hide_bar = args.no_progress or args.quiet
        overrides = list(args.overrides) + (["train.progress=false"] if hide_bar else [])
        if args.max_restarts and args.nproc is None:
            raise RecaccelError(
                "--max-restarts restarts the ranks of --nproc N; under your own torchrun pass its --max-restarts"
            )
        if args.resume and args.overwrite:
            raise RecaccelError(
                "--resume continues the run in RUN_DIR; --overwrite would delete it: pass one"
            )
        if args.resume and args.config:
            raise RecaccelError(
                "--resume reads the run's own config.toml; pass --set to change it, not --config"
            )
        files = args.config or []
        cfg = api.run_config(args.resume, overrides) if args.resume else load_config(files, overrides)
        if args.print_config:
            print(config_to_toml(cfg), end="")
            return 0
        if args.nproc is not None:
            api.check_launch(cfg, args.nproc)  # a config not in hybrid mode: that line first
        # Refused here in one line, naming the recaccel-data command of missing data.
        preflight(cfg, config_files=files)
        return _launched(cfg, args) if args.nproc is not None else _trained(cfg, args)

    return run_command("recaccel-train", body)


def _trained(cfg: Config, args: argparse.Namespace) -> int:
    """Trains in this process (or as a rank of one's own torchrun: rank 0 reports)."""
    import os

    from recaccel import api

    resume, overwrite = run_flags(resume=bool(args.resume), overwrite=args.overwrite)
    main_rank = os.environ.get("RANK", "0") == "0"
    with third_party_warnings(verbose=args.verbose, quiet=args.quiet, main_rank=main_rank):
        metrics = api.train(cfg, resume=resume, overwrite=overwrite)
    if main_rank:
        _draw_profile(cfg)
        _report(metrics, cfg, quiet=args.quiet)
    return 0


def _launched(cfg: Config, args: argparse.Namespace) -> int:
    """``--nproc N``: runs the ranks (:func:`recaccel.launch`) and reports; ranks a signal
    stopped cleanly exit 143 (SIGTERM) or 130 (SIGINT), rank 0 having printed where the
    run resumes."""
    from recaccel import api
    from recaccel.train.loop.preemption import Preempted

    try:
        metrics = api.launch(
            cfg,
            nproc=args.nproc,
            max_restarts=args.max_restarts,
            resume=bool(args.resume),
            overwrite=args.overwrite,
        )
    except Preempted as stopped:
        return stopped.exit_status
    _draw_profile(cfg)
    _report(metrics, cfg, quiet=args.quiet)
    return 0


def run_flags(*, resume: bool, overwrite: bool) -> tuple[bool, bool]:
    """A rank's ``(resume, overwrite)``: one that torchrun's agent restarted after a
    failure continues the run, never starts (or overwrites) it again."""
    from recaccel.train.distributed.launch import restart_count, under_torchrun

    restarted = under_torchrun() and restart_count() > 0
    return resume or restarted, overwrite and not restarted


def third_party_warnings(*, verbose: bool, quiet: bool, main_rank: bool) -> AbstractContextManager[object]:
    """Third-party warnings (torch, torchrec, ...) summed up in one line unless ``verbose``;
    ranks other than 0 show none of them (each rank would repeat rank 0's)."""
    from recaccel.train.run.console import hidden_warnings

    if verbose and main_rank:
        return nullcontext()
    return hidden_warnings(show_summary=main_rank and not quiet)


def _draw_profile(cfg: Config) -> None:
    """The timeline picture next to the run's profile trace (train.profile_steps), if written."""
    from recaccel.train.run.profiling import trace_path

    steps = cfg.train.profile_steps
    if steps and trace_path(Path(cfg.train.out_dir), steps).is_file():
        from recaccel.plotting.profile import draw_profile

        draw_profile(trace_path(Path(cfg.train.out_dir), steps))


def _report(metrics: dict[str, Any], cfg: Config, *, quiet: bool) -> None:
    """The run's metrics: one line with ``quiet``, else the table."""
    out_dir = Path(cfg.train.out_dir)
    if quiet:
        from recaccel.train.run.console import final_line

        print(final_line(metrics, str(out_dir / "metrics.json")))
    else:
        print_metrics(metrics, out_dir, Path(cfg.data.test).parent)
