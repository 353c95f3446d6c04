"""Checkpoints: model, optimizer, reader position and RNG state in one file.

Every entry is a tensor, a number, a string or a container of those, so checkpoints
load with ``torch.load(weights_only=True)``; the reader position is stored as JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recaccel.errors import RecaccelError

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"step-(\d+)\.pt$")


@dataclass
class TrainState:
    """Where training stands: counters and the reader position of the next batch."""

    step: int = 0
    epoch: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    reader: dict[str, Any] | None = None


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": json.dumps(random.getstate()),
        "numpy": json.dumps(np.random.get_state(legacy=False), default=_np_json),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(json.loads(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def state_entries(state: TrainState) -> dict[str, Any]:
    """The checkpoint entries of ``state``: its counters, its reader position (JSON) and the
    current RNG state."""
    return {
        "step": state.step,
        "epoch": state.epoch,
        "samples": state.samples,
        "train_seconds": state.train_seconds,
        "reader": json.dumps(state.reader),
        "rng": rng_state(),
    }


def restore_state(entries: dict[str, Any]) -> TrainState:
    """Restores the RNG state of :func:`state_entries`' output and returns its TrainState."""
    rng = entries["rng"]
    rng["torch"] = rng["torch"].cpu()
    if "cuda" in rng:
        rng["cuda"] = [s.cpu() for s in rng["cuda"]]
    set_rng_state(rng)
    return TrainState(
        step=entries["step"],
        epoch=entries["epoch"],
        samples=entries["samples"],
        train_seconds=entries["train_seconds"],
        reader=json.loads(entries["reader"]),
    )


def _np_json(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    raise TypeError(f"cannot serialize {type(obj)}")


def save_checkpoint(
    run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, keep: int = 2
) -> Path:
    """Writes ``run_dir/checkpoints/step-<step>.pt`` atomically and prunes old ones."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{state.step:09d}.pt"
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state_entries(state)}
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [p for p in folder.glob("step-*.pt") if _NAME.search(p.name)]
    return sorted(found, key=lambda p: int(_NAME.search(p.name).group(1)))


def load_checkpoint(
    run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> TrainState:
    """Restores the newest checkpoint of ``run_dir`` into model and optimizer.

    Raises:
        RecaccelError: if the run has no checkpoint or it cannot be read.
    """
    found = list_checkpoints(run_dir)
    if not found:
        raise RecaccelError(f"no checkpoint in {Path(run_dir) / CHECKPOINT_DIR}; cannot resume")
    path = found[-1]
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise RecaccelError(f"cannot load checkpoint {path}: {e}") from None
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    return restore_state(payload)
