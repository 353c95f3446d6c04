"""recaccel-export: a run's model as a TorchRec state dict or a torch.export program."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from recaccel.cli.common import run_command, setup_logging


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recaccel-export",
        description="Export a run's model (newest checkpoint, or --checkpoint STEP). "
        "torchrec: a state dict that torchrec.models.dlrm.DLRM (DLRM_DCN for DCN-v2) loads, and OUT.json "
        "with its constructor arguments. torch_export: a torch.export program (OUT, e.g. model.pt2) over "
        "plain tensors (dense [B, Dd], ids values [N], offsets [F*B+1]) returning probabilities or ratings, "
        "and OUT.json describing its inputs. See docs/export.md.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (config.toml, checkpoints/)")
    parser.add_argument("out", metavar="OUT", help="the file to write (its .json description goes beside it)")
    parser.add_argument(
        "--format", dest="fmt", required=True, metavar="FORMAT", help="torchrec or torch_export"
    )
    parser.add_argument(
        "--checkpoint", type=int, metavar="STEP", help="the step to export (default: the newest)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing OUT and its .json (never the run's own files or its data)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


def export_main(argv: Sequence[str] | None = None) -> int:
    args = export_parser().parse_args(argv)
    setup_logging(args.verbose)

    def body() -> int:
        from recaccel.export import export_run

        written = export_run(args.run_dir, args.fmt, args.out, checkpoint=args.checkpoint, force=args.force)
        print(f"exported step {written['step']} ({written['checkpoint']}) as {written['format']}")
        print(f"model written to {written['path']}")
        print(f"description written to {written['spec']}")
        return 0

    return run_command("recaccel-export", body)
