"""What a benchmark result depends on: device, library versions, date, git commit."""

from __future__ import annotations

import datetime as _dt
import platform
import subprocess
from pathlib import Path

import torch


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], check=False, capture_output=True, text=True, timeout=5, cwd=PROJECT_ROOT
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# The checkout holding the recaccel package (recaccel/ sits in it).
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def _git_commit() -> str:
    """The project's own commit, or ``"unknown"``: a tree copied without its ``.git`` into
    another repository must not report that repository's commit."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != PROJECT_ROOT:
        return "unknown"
    return _git("rev-parse", "--short", "HEAD") or "unknown"


def environment_info(device: torch.device | str) -> dict:
    """What a result depends on: device, library versions, date (UTC), git commit."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": _git_commit(),
    }
