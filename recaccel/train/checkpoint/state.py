"""Checkpoints: model, optimizer, reader position and RNG state in one file.

Every entry is a tensor, a number, a string or a container of those, so checkpoints
load with ``torch.load(weights_only=True)``; the reader position is stored as JSON.

Tamper evidence: ``step-<step>.pt`` has its SHA-256 in ``step-<step>.pt.sha256``
(``sha256sum -c`` reads it), checked before every read (resume, evaluation, export). The
digest file is renamed into place (and its directory entry fsynced) *before* the
checkpoint, so a kill or power loss at any point never leaves a visible checkpoint that
fails its check: at worst a digest file without its checkpoint (removed at the next
save). Re-saving a step lists the old file's digest beside the new one until the new file
is in place. A checkpoint without a digest file (written before recaccel recorded them,
or copied without it) is accepted once its zip CRC-32s pass, with a warning.

``train.keep_checkpoints`` step checkpoints stay (the newest). ``best.pt`` (with
``train.best_metric``) is written the same way, digest file first, and replaced at each
better evaluation (:mod:`recaccel.train.checkpoint.best`).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recaccel.errors import RecaccelError
from recaccel.io.readers.protocol import Reader
from recaccel.io.readers.state import are_counters
from recaccel.train.checkpoint.digests import file_sha256, fsync_path, read_digests, write_digests
from recaccel.train.checkpoint.errors import CheckpointError, first_line
from recaccel.train.checkpoint.paths import (
    DIGEST_SUFFIX,
    digest_file,
    list_checkpoints,
    named_step,
    newest_checkpoint,
)
from recaccel.train.checkpoint.payload import (
    STATE_KEYS,
    apply_state,
    check_entries,
    check_module_state,
    check_optimizer_state,
    python_rng_state,
    read_payload,
)
from recaccel.train.run.runlog import CHECKPOINT_DIR

BEST_FILE = "best.pt"  # in checkpoints/: the checkpoint of train.best_metric's best evaluation


@dataclass
class TrainState:
    """Where training stands: counters, the reader position of the next batch, the
    reader's counters at that position (``data``, metrics.json's ``data``) and the last
    logged training loss (metrics.json's ``train_loss``), so a resumed run reports what
    an uninterrupted one does."""

    step: int = 0
    epoch: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    reader: dict[str, Any] | None = None
    data: dict[str, int] | None = None
    last_loss: float = math.nan
    best: BestRecord | None = None  # train.best_metric's best evaluation so far


@dataclass
class BestRecord:
    """The best periodic evaluation so far (``train.best_metric``) and the early-stopping
    count: evaluations since it, and the step the run stopped early at (None: it did not)."""

    value: float
    step: int
    evals_since: int = 0
    stopped_at: int | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "value": self.value,
                "step": self.step,
                "evals_since": self.evals_since,
                "stopped_at": self.stopped_at,
            }
        )

    @classmethod
    def from_json(cls, text: Any) -> BestRecord | None:
        """The record of a ``best`` entry (JSON text of null or of the object ``to_json`` writes).

        Raises:
            ValueError: malformed.
        """
        if not isinstance(text, str):
            raise ValueError(f"entry 'best' must be JSON text, got {type(text).__name__}")
        value = json.loads(text)
        if value is None:
            return None
        if not isinstance(value, dict) or set(value) != {"value", "step", "evals_since", "stopped_at"}:
            raise ValueError(
                f"entry 'best' must hold value, step, evals_since and stopped_at, got {text[:80]!r}"
            )
        counts = [value["step"], value["evals_since"]] + (
            [] if value["stopped_at"] is None else [value["stopped_at"]]
        )
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError(f"entry 'best' must hold non-negative step counts, got {text[:80]!r}")
        if isinstance(value["value"], bool) or not isinstance(value["value"], (int, float)):
            raise ValueError(f"entry 'best' must hold a numeric value, got {text[:80]!r}")
        return cls(float(value["value"]), value["step"], value["evals_since"], value["stopped_at"])


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
    random.setstate(python_rng_state(state["python"]))
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
        "data": json.dumps(state.data),
        "last_loss": float(state.last_loss),
        "rng": rng_state(),
        # only with train.best_metric: a run without it writes what older recaccel wrote
        **({"best": state.best.to_json()} if state.best is not None else {}),
    }


def restore_state(entries: dict[str, Any]) -> TrainState:
    """Restores the RNG state of :func:`state_entries`' output and returns its TrainState.

    Checkpoints written before ``data``, ``last_loss`` and ``best`` existed load with None,
    NaN and None.

    Raises:
        ValueError: a malformed ``data`` or ``last_loss`` entry (checked before any state is set).
    """
    data = _saved_data(entries.get("data", "null"))
    best = BestRecord.from_json(entries.get("best", "null"))
    last_loss = entries.get("last_loss", math.nan)
    if isinstance(last_loss, bool) or not isinstance(last_loss, (int, float)):
        raise ValueError(f"entry 'last_loss' must be a number, got {type(last_loss).__name__}")
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
        data=data,
        last_loss=float(last_loss),
        best=best,
    )


def _saved_data(text: Any) -> dict[str, int] | None:
    """The reader counters of a ``data`` entry: JSON text of null or of an object of
    non-negative ints."""
    if not isinstance(text, str):
        raise ValueError(f"entry 'data' must be JSON text, got {type(text).__name__}")
    value = json.loads(text)
    if value is None:
        return None
    if not are_counters(value):
        raise ValueError(f"entry 'data' must hold an object of non-negative counts, got {text[:80]!r}")
    return value


def _np_json(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    raise TypeError(f"cannot serialize {type(obj)}")


def save_checkpoint(
    run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, keep: int = 2
) -> Path:
    """Writes ``run_dir/checkpoints/step-<step>.pt`` and its digest file atomically, and
    keeps the newest ``keep`` of them (see the module docstring for the order)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folder = Path(run_dir) / CHECKPOINT_DIR
    path = _write_checkpoint(folder / f"step-{state.step:09d}.pt", model, optimizer, state)
    _prune(folder, list_checkpoints(run_dir)[:-keep])
    return path


def save_best(
    run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState
) -> Path:
    """Writes ``run_dir/checkpoints/best.pt`` (a checkpoint like ``step-<step>.pt``, with its
    digest file, atomically), replacing the previous best."""
    return _write_checkpoint(Path(run_dir) / CHECKPOINT_DIR / BEST_FILE, model, optimizer, state)


def _write_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState
) -> Path:
    """Writes the checkpoint file ``path`` and its digest file atomically (module docstring)."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state_entries(state)}
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    digest = file_sha256(tmp)
    previous = _current_digests(path)
    write_digests(path, [digest, *previous])  # the file under this name verifies, old or new
    os.replace(tmp, path)
    fsync_path(folder)  # and so is the rename
    if previous:
        write_digests(path, [digest])
    return path


def _current_digests(path: Path) -> list[str]:
    """The digests the checkpoint now at ``path`` verifies against (none: no file there)."""
    if not path.exists():
        return []
    try:
        recorded = read_digests(digest_file(path), path)
    except CheckpointError:  # a damaged digest file: the bytes there are what a kill would leave
        recorded = None
    return sorted(recorded) if recorded else [file_sha256(path)]


def _prune(folder: Path, old: list[Path]) -> None:
    """Deletes the checkpoints ``old``, each before its digest file, then digest files whose
    checkpoint is gone (a kill between a digest file's rename and its checkpoint's)."""
    for path in old:
        path.unlink()
        digest_file(path).unlink(missing_ok=True)
    for sidecar in folder.glob(f"step-*.pt{DIGEST_SUFFIX}"):
        if not sidecar.with_suffix("").exists():
            sidecar.unlink(missing_ok=True)


def load_checkpoint(
    run_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    path: Path | None = None,
) -> TrainState:
    """Restores the newest checkpoint of ``run_dir`` (or the file ``path``) into model and optimizer.

    The file is untrusted input: it is unpickled restricted to tensors, numbers, strings
    and containers, and every entry is checked against the run before any is applied.

    Raises:
        RecaccelError: if the run has no checkpoint, or one line naming the checkpoint and
            its first problem (unreadable, unsafe, a missing or malformed entry, a state
            dict that does not fit the model or optimizer).
    """
    found = list_checkpoints(run_dir) if path is None else [Path(path)]
    if not found:
        raise RecaccelError(f"no checkpoint in {Path(run_dir) / CHECKPOINT_DIR}; cannot resume")
    path = found[-1]
    payload = read_payload(path, path, device)
    check_entries(path, payload, ("model", "optimizer", *STATE_KEYS))
    check_module_state(path, "model", model, payload["model"])
    check_optimizer_state(path, "optimizer", optimizer, payload["optimizer"])
    apply_state(path, "model", model.load_state_dict, payload["model"])
    apply_state(path, "optimizer", optimizer.load_state_dict, payload["optimizer"])
    return restore_checked(path, payload)


def load_reader_position(reader: Reader, position: dict[str, Any], run_dir: Path) -> None:
    """``reader.load_state_dict(position)`` for the position a resume read from ``run_dir``:
    a position the reader refuses (other settings or data, or malformed) is reported
    naming the checkpoint it came from.

    Raises:
        RecaccelError: ``checkpoint <newest>: its reader position does not fit this run: ...``.
    """
    try:
        reader.load_state_dict(position)
    except RecaccelError as e:
        what = f"its reader position does not fit this run: {e}"
        raise CheckpointError(newest_checkpoint(run_dir), what) from None


def restore_checked(path: Path, entries: dict[str, Any]) -> TrainState:
    """:func:`restore_state` of checked entries; what the checks leave to it (newer,
    optional entries) fails in one line naming ``path``, as does a step other than the one
    its name says (the run would go on counting from a step it never trained)."""
    try:
        state = restore_state(entries)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise CheckpointError(path, f"bad training state ({type(e).__name__}: {first_line(e)})") from None
    named = named_step(path)
    if named is not None and state.step != named:
        raise CheckpointError(path, f"entry 'step' is {state.step}, but the file is named for step {named}")
    return state
