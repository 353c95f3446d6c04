"""Evaluating one checkpoint of a run, in one process, optionally with per-row predictions.

A run keeps ``step-<step>.pt`` files (single-process runs) or ``step-<step>.dcp`` folders
(hybrid runs: each rank wrote its shards of the tables) under ``run_dir/checkpoints/``.
Evaluation always runs in one process: a DCP folder is read whole, DCP assembling every
table's shards into one full tensor, so a hybrid run is scored without launching its ranks
again (its tables must fit this host's memory). Only the model is restored: the optimizer,
reader position and random state of a checkpoint play no part in scoring.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from recaccel.config import Config
from recaccel.errors import RecaccelError
from recaccel.train.checkpoint import TrainState, load_checkpoint
from recaccel.train.checkpoint_io import (
    CheckpointError,
    apply_state,
    check_module_state,
    dcp_failure,
    first_line,
    safe_dcp_planner,
    safe_dcp_reader,
)
from recaccel.train.checkpoint_paths import all_checkpoints
from recaccel.train.parallel import SingleProcess
from recaccel.train.predictions import write_predictions
from recaccel.train.runlog import CHECKPOINT_DIR

_STEP = re.compile(r"step-(\d+)\.(pt|dcp)$")


def evaluate_run(
    cfg: Config,
    path: str | Path | None = None,
    *,
    checkpoint: int | None = None,
    predictions: str | Path | None = None,
    model: Any = None,
) -> dict[str, Any]:
    """Scores a checkpoint of the run in ``cfg.train.out_dir`` on ``path`` (default
    ``data.test``), in this process; the run directory is only read.

    Args:
        cfg: the run's config (a hybrid run's is evaluated as ``parallel.mode=single``).
        path: the data to score.
        checkpoint: the step of the checkpoint (default: the newest).
        predictions: a Parquet file to write one prediction per evaluation row to
            (:mod:`recaccel.train.predictions`).
        model: the run's own model, as given to ``recaccel.train`` (None: recaccel's).

    Returns:
        The metrics, with ``checkpoint_step`` (and ``predictions``: the file written).

    Raises:
        RecaccelError: no such checkpoint (one line listing the steps there are), or one
            that does not fit the model.
    """
    from recaccel.io.loader import DeviceLoader
    from recaccel.train.trainer import Trainer, resolve_device

    chosen = pick_checkpoint(cfg.train.out_dir, checkpoint)
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mode="single"))
    process = CheckpointProcess(resolve_device(cfg.train.device), chosen)
    extra = {} if model is None else {"model": model}
    trainer = Trainer(single, resume=True, parallel=process, **extra)
    source = str(path or cfg.data.test)
    reader = trainer.evaluator.reader(source, train=False, rank=0, world_size=1)
    loader = DeviceLoader(reader, trainer.device, cfg.data.prefetch, backend=cfg.data.loader_backend)
    columns: dict[str, Tensor] = {}
    trainer.module.eval()
    metrics = trainer.evaluator.evaluate(
        loader, gather=process.gather, source=source, predictions=columns.update if predictions else None
    )
    metrics["checkpoint_step"] = trainer.state.step
    if predictions:
        info = {"run": str(cfg.train.out_dir), "checkpoint_step": trainer.state.step, "data": source}
        metrics["predictions"] = str(
            write_predictions(predictions, columns, {**info, "loss": trainer.evaluator.loss})
        )
    return metrics


def checkpoint_steps(run_dir: str | Path) -> dict[int, Path]:
    """A run's checkpoints by step (a ``.pt`` file wins over a ``.dcp`` folder of the same step)."""
    found: dict[int, Path] = {}
    for path in all_checkpoints(Path(run_dir)):
        step = int(_STEP.search(path.name).group(1))
        if step not in found or path.suffix == ".pt":
            found[step] = path
    return dict(sorted(found.items()))


def pick_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint of ``run_dir`` at ``step`` (default: the newest).

    Raises:
        RecaccelError: no run directory, no checkpoint, or no checkpoint at ``step``;
            one line listing the steps there are.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RecaccelError(f"run directory {run_dir} does not exist")
    found = checkpoint_steps(run_dir)
    if not found:
        raise RecaccelError(
            f"run {run_dir} has no checkpoint (no step-*.pt or step-*.dcp in {CHECKPOINT_DIR}/)"
        )
    if step is None:
        return found[max(found)]
    if step not in found:
        steps = ", ".join(str(s) for s in found)
        raise RecaccelError(f"run {run_dir} has no checkpoint at step {step}; available steps: {steps}")
    return found[step]


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's name."""
    return int(_STEP.search(Path(path).name).group(1))


class CheckpointProcess(SingleProcess):
    """One process whose ``load_checkpoint`` restores the model of one named checkpoint.

    Handed to :class:`~recaccel.train.trainer.Trainer` (``resume=True``), it scores the
    checkpoint at ``path`` instead of resuming the newest one.

    Args:
        device: where the model runs.
        path: a ``step-*.pt`` file or a complete ``step-*.dcp`` folder.
    """

    def __init__(self, device: torch.device, path: Path) -> None:
        super().__init__(device)
        self.path = Path(path)

    def load_checkpoint(self, run_dir: Path, model: nn.Module, optimizer: Any) -> TrainState:
        """Loads ``self.path``: a ``.pt`` file whole (model and optimizer), of a ``.dcp``
        folder the model only."""
        if self.path.suffix == ".pt":  # checked entirely, as a resume checks it
            return load_checkpoint(run_dir, model, optimizer, self.device, path=self.path)
        load_sharded_model(self.path, model)
        return TrainState(step=checkpoint_step(self.path))


def load_sharded_model(path: Path, model: nn.Module) -> None:
    """The model of a hybrid run's ``step-*.dcp`` folder into a single-process ``model``.

    The dense entries are the folder's ``model.*``; each table's rows [R, D] are read whole
    from its shards (``embedding.*``, sharded by TorchRec) or from the data-parallel copy
    (``replicated.*``) into ``<embedding prefix><table>.weight``. Optimizer state is not read.

    Raises:
        CheckpointError: the folder is unreadable, or lacks (or has extra) model entries.
    """
    reader = safe_dcp_reader(path)
    metadata = reader.read_metadata().state_dict_metadata
    targets: dict[str, Tensor] = {}
    for key, meta in metadata.items():
        if not hasattr(meta, "size"):  # bytes: optimizer blobs and the per-rank state
            continue
        section, _, rest = key.partition(".")
        if section == "model" or (section in ("embedding", "replicated") and rest.endswith(".weight")):
            targets[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    _read_dcp(path, reader, targets)
    state = _single_layout(path, targets, _embedding_prefix(model))
    expected = model.state_dict()
    # The optimizer state the single-process embedding keeps beside its rows is not scored.
    missing = [k for k in expected if k not in state and not _is_table_state(k, expected)]
    if missing:
        raise CheckpointError(path, f"has no entry for {missing[0]!r} of this model")
    for key, value in expected.items():
        state.setdefault(key, value)
    check_module_state(path, "model", model, state)
    apply_state(path, "model", model.load_state_dict, state)


def _read_dcp(path: Path, reader: Any, targets: dict[str, Tensor]) -> None:
    """``dcp.load`` of the flat ``targets`` in this process alone (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ShardedTensor", category=FutureWarning)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(
                targets,
                checkpoint_id=str(path),
                storage_reader=reader,
                planner=safe_dcp_planner(path),
                no_dist=True,
            )
    except CheckpointException as e:
        raise dcp_failure(path, e) from None
    except (ValueError, KeyError, TypeError, AssertionError, OSError, RuntimeError) as e:
        raise CheckpointError(path, f"cannot be read ({type(e).__name__}: {first_line(e)})") from None


def _single_layout(path: Path, flat: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Flat DCP entries -> a single-process state dict: ``model.<k>`` -> ``<k>``, a table's
    ``embedding.<...>.<table>.weight`` or ``replicated.<table>.weight`` -> ``<prefix><table>.weight``."""
    out: dict[str, Tensor] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        if section == "model":
            out[rest] = value
            continue
        table = rest.split(".")[-2]
        name = f"{prefix}{table}.weight"
        if name in out:
            raise CheckpointError(path, f"holds table {table!r} twice ({key!r})")
        out[name] = value
    return out


def _embedding_prefix(model: nn.Module) -> str:
    """The state-dict prefix of the model's one SparseArch embedding (as hybrid mode names it)."""
    from recaccel.models.arches import SparseArch

    names = [name for name, m in model.named_modules() if isinstance(m, SparseArch)]
    if len(names) != 1:
        raise RecaccelError(
            f"a hybrid checkpoint needs a model with one SparseArch, this one has {len(names)}"
        )
    return f"{names[0]}.embedding." if names[0] else "embedding."


def _is_table_state(key: str, expected: dict[str, Any]) -> bool:
    """Whether ``key`` is per-table optimizer state (or the rounding state) of the embedding:
    a key ``<prefix><table>.<name>`` other than ``weight`` whose table has a ``weight`` key."""
    stem, _, name = key.rpartition(".")
    return name != "weight" and (f"{stem}.weight" in expected or "rounding" in name)
