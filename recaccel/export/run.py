"""``export_run``: one call from a run directory to an exported file (what recaccel-export runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recaccel.errors import ConfigError
from recaccel.export.load import load_run

FORMATS = ("torchrec", "torch_export")


def export_run(
    run_dir: str | Path, fmt: str, out: str | Path, checkpoint: int | None = None
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
        out: the file to write (its folder is created; an existing file is replaced).
        checkpoint: the training step of the checkpoint to export; None = the newest.

    Returns:
        ``{"format", "path", "spec", "step", "checkpoint"}``: what was written.

    Raises:
        RecaccelError: an unknown format, no run or checkpoint, or a model the format
            cannot express (one line each).
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
    loaded = load_run(run_dir, checkpoint)
    if fmt == "torchrec":
        from recaccel.export.torchrec_format import torchrec_spec, torchrec_state_dict

        spec = torchrec_spec(loaded)
        state = torchrec_state_dict(loaded)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out)
    else:
        from recaccel.export.serving import export_program, save_program, serving_spec

        spec = serving_spec(loaded)
        program = export_program(loaded)
        out.parent.mkdir(parents=True, exist_ok=True)
        save_program(program, out)
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    return {
        "format": fmt,
        "path": str(out),
        "spec": str(spec_path),
        "step": loaded.step,
        "checkpoint": str(loaded.checkpoint),
    }
