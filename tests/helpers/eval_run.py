"""The run recaccel-eval tests score, and the metrics it prints."""

from __future__ import annotations

STEPS, EVERY = 12, 6  # checkpoints at steps 6 and 12


def printed_metrics(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.splitlines() if line and not line.endswith(".json"))
