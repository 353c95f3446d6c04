"""``export_run``: one call from a run directory to an exported file (what recaccel-export runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recaccel.errors import ConfigError
from recaccel.export.load import load_run
from recaccel.output_paths import Read, check_output, run_reads, write_atomic, write_text_atomic

FORMATS = ("torchrec", "torch_export")


def export_run(
    run_dir: str | Path, fmt: str, out: str | Path, checkpoint: int | None = None, *, force: bool = False
) -> dict[str, Any]:
    """Exports the newest (or the ``checkpoint`` step's) model of a run.

    ``torchrec`` writes ``out`` (a ``torch.save`` state dict of TorchRec's DLRM / DLRM_DCN)
    and ``out`` with suffix ``.json`` (its constructor arguments, see
    :func:`recaccel.export.torchrec_format.build_torchrec_model`); ``torch_export`` writes
    ``out`` (a ``torch.export`` program, conventionally ``.pt2``) and the ``.json``
    describing its inputs and output (see :mod:`recaccel.export.serving`).

    Args:
        run_dir: the run directory.
        fmt: ``torchrec`` or ``torch_export``.
        out: the file to write (its folder is created); it and its ``.json`` are written
            atomically, and checked before the model is read.
        checkpoint: the training step of the checkpoint to export; None = the newest.
        force: replace an existing ``out`` or ``.json`` (never a file the export reads:
            the run's own files, its checkpoints, its training data).

    Returns:
        ``{"format", "path", "spec", "step", "checkpoint"}``: what was written.

    Raises:
        RecaccelError: an unknown format, no run or checkpoint, an output that exists
            (without ``force``) or is an input, or a model the format cannot express (one
            line each).
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out = Path(out)
    spec_path = out.with_suffix(".json")
    if spec_path == out:
        raise ConfigError(
            f"export output {out} must not be a .json file (the description goes to {spec_path.name})"
        )
    if fmt == "torch_export" and out.suffix != ".pt2":
        raise ConfigError(f"--format torch_export writes a .pt2 archive (torch.export.save); got OUT={out}")
    check_outputs(run_dir, checkpoint, out, spec_path, force=force)
    loaded = load_run(run_dir, checkpoint)
    if fmt == "torchrec":
        from recaccel.export.torchrec_format import torchrec_spec, torchrec_state_dict

        spec = torchrec_spec(loaded)
        state = torchrec_state_dict(loaded)
        write_atomic(out, lambda tmp: torch.save(state, tmp))
    else:
        from recaccel.export.serving import export_program, save_program, serving_spec

        spec = serving_spec(loaded)
        program = export_program(loaded)
        write_atomic(out, lambda tmp: save_program(program, tmp))
    write_text_atomic(spec_path, json.dumps(spec, indent=2) + "\n")
    return {
        "format": fmt,
        "path": str(out),
        "spec": str(spec_path),
        "step": loaded.step,
        "checkpoint": str(loaded.checkpoint),
    }


def check_outputs(
    run_dir: str | Path, checkpoint: int | None, out: Path, spec_path: Path, *, force: bool
) -> None:
    """Refuses ``out`` or ``spec_path`` where it is a file the export reads (the run's own
    files, the checkpoint, the training data whose footers give the schema) or, without
    ``force``, exists.

    Raises:
        RecaccelError: no run or checkpoint; OutputError naming OUT and the path.
    """
    from recaccel.api import run_config
    from recaccel.train.evaluation.from_checkpoint import pick_checkpoint
    from recaccel.train.run.runlog import CONFIG_FILE, RUN_FILES

    chosen = pick_checkpoint(run_dir, checkpoint)
    reads = [*run_reads(run_dir, RUN_FILES), Read(chosen, "the checkpoint this command reads")]
    if (Path(run_dir) / CONFIG_FILE).is_file():  # else load_run says it is no run directory
        reads.append(Read(Path(run_config(run_dir).data.train), "the run's training data"))
    check_output(out, flag="OUT", force=force, reads=reads)
    check_output(spec_path, flag="OUT's description", force=force, reads=reads)
