"""Where a hybrid run's checkpoints lie."""

from __future__ import annotations

from pathlib import Path

STEPS = 5  # an epoch is 23 steps: the checkpoint holds a mid-epoch reader position


def dcp_folder(run: Path) -> Path:
    return next((run / "checkpoints").glob("step-*.dcp"))
