"""Evaluating one checkpoint of a run, in one process, optionally with per-row predictions.

A run keeps ``step-<step>.pt`` files (single-process runs) or ``step-<step>.dcp`` folders
(hybrid runs: each rank wrote its shards of the tables) under ``run_dir/checkpoints/``.
Evaluation always runs in one process: a DCP folder is read whole, DCP assembling every
table's shards into one full tensor, so a hybrid run is scored without launching its ranks
again (its tables must fit this host's memory). Only the model is restored: the optimizer,
reader position and random state of a checkpoint play no part in scoring, but a checkpoint is
checked as a resume checks it first (its SHA-256s, then its entries), so a corrupted or
crafted one is refused in the same line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from recaccel.config import Config
from recaccel.errors import RecaccelError
from recaccel.train.checkpoint.dcp_read import safe_dcp_reader
from recaccel.train.checkpoint.errors import CheckpointError, first_line, show
from recaccel.train.checkpoint.paths import INFO_FILE, all_checkpoints, named_step
from recaccel.train.checkpoint.payload import apply_state, check_module_state
from recaccel.train.checkpoint.state import TrainState, load_checkpoint
from recaccel.train.evaluation.predictions import write_predictions
from recaccel.train.loop.parallel import SingleProcess
from recaccel.train.run.runlog import CHECKPOINT_DIR
from recaccel.train.run.sanity import first_batch

logger = logging.getLogger(__name__)


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
            (:mod:`recaccel.train.evaluation.predictions`).
        model: the run's own model, as given to ``recaccel.train`` (None: recaccel's).

    Returns:
        The metrics, with ``checkpoint_step`` (and ``predictions``: the file written).

    Raises:
        RecaccelError: no such checkpoint (one line listing the steps there are), or one
            that does not fit the model.
    """
    from tqdm.auto import tqdm

    from recaccel.io.loader import DeviceLoader
    from recaccel.train.loop.trainer import Trainer, resolve_device

    chosen = pick_checkpoint(cfg.train.out_dir, checkpoint)
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mode="single"))
    process = CheckpointProcess(resolve_device(cfg.train.device), chosen, cfg)
    extra = {} if model is None else {"model": model}
    trainer = Trainer(single, resume=True, parallel=process, **extra)
    source = str(path or cfg.data.test)
    # Another schema or ids past the model's tables: one line naming the file, as training
    # names its data.test (the lookup's own error names the column only).
    label = "the data scored" if path is not None else "config key data.test"
    first_batch(trainer.evaluator, source, label, trainer.schema)
    reader = trainer.evaluator.reader(source, train=False, rank=0, world_size=1)
    loader = DeviceLoader(reader, trainer.device, cfg.data.prefetch, backend=cfg.data.loader_backend)
    columns: dict[str, Tensor] = {}
    trainer.module.eval()
    # A bar on a terminal only (total: the reader's batches when known), gone when done.
    bar = tqdm(loader, total=reader.num_batches, desc="eval", unit="batch", leave=False, disable=None)
    with bar:
        metrics = trainer.evaluator.evaluate(
            bar, gather=process.gather, source=source, predictions=columns.update if predictions else None
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
        step = checkpoint_step(path)
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


def eval_file_name(step: int, data: str | Path, run_test: str | Path) -> str:
    """The file recaccel-eval writes a checkpoint's metrics to in the run directory.

    ``eval-<step>.json`` for the run's own ``data.test``; for other data
    ``eval-<step>-<hash>.json``, ``<hash>`` the first 8 hex digits of the SHA-256 of the
    data's absolute path: evaluations of one step on different data keep a file each, and
    the same data again is refused without --force, as any existing output is.

    Args:
        step: the checkpoint's training step.
        data: the data scored.
        run_test: the run's ``data.test``.
    """
    where = Path(data).resolve()
    if where == Path(run_test).resolve():
        return f"eval-{step}.json"
    return f"eval-{step}-{hashlib.sha256(str(where).encode()).hexdigest()[:8]}.json"


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's name (a name :func:`~recaccel.train.checkpoint.paths.all_checkpoints` lists)."""
    step = named_step(path)
    if step is None:
        raise ValueError(f"{path}: not a checkpoint's name (step-<step>.pt or step-<step>.dcp)")
    return step


class CheckpointProcess(SingleProcess):
    """One process whose ``load_checkpoint`` restores the model of one named checkpoint.

    Handed to :class:`~recaccel.train.loop.trainer.Trainer` (``resume=True``), it scores the
    checkpoint at ``path`` instead of resuming the newest one.

    Args:
        device: where the model runs.
        path: a ``step-*.pt`` file or a complete ``step-*.dcp`` folder.
        cfg: the run's config (a hybrid run's table sharding names its data-parallel tables).
    """

    def __init__(self, device: torch.device, path: Path, cfg: Config) -> None:
        super().__init__(device)
        self.path = Path(path)
        self.cfg = cfg

    def load_checkpoint(self, run_dir: Path, model: nn.Module, optimizer: Any) -> TrainState:
        """Loads ``self.path``, checked entirely as a resume checks it: a ``.pt`` file whole
        (model and optimizer), of a ``.dcp`` folder the model only."""
        if self.path.suffix == ".pt":
            return load_checkpoint(run_dir, model, optimizer, self.device, path=self.path)
        load_sharded_model(self.path, model, self.cfg, optimizer)
        return TrainState(step=checkpoint_step(self.path))


def load_sharded_model(
    path: Path, model: nn.Module, cfg: Config | None = None, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """The model of a hybrid run's ``step-*.dcp`` folder into a single-process ``model``.

    The dense entries are the folder's ``model.*``; each table's rows [R, D] are read whole
    from its shards (``embedding.*``, sharded by TorchRec) or from the data-parallel copy
    (``replicated.*``) into ``<embedding prefix><table>.weight``. The folder is checked as
    a resume checks it before the model is touched: every file's SHA-256 recorded in
    ``recaccel.json``, every rank's
    ``ranks.<r>`` entry, and with ``cfg`` the optimizer entries (not applied):
    ``dense_optim`` against ``optimizer`` and ``replicated_optim`` against the optimizer
    the run's data-parallel tables had.

    Args:
        path: the ``step-*.dcp`` folder.
        model: the single-process model.
        cfg: the run's config (None: the optimizer entries are not checked).
        optimizer: the single-process dense optimizer; it covers the parameters hybrid
            mode's does, since hybrid mode only moves the embedding (whose rows are
            buffers, updated in backward) into TorchRec (None: one built from ``cfg``).

    Raises:
        CheckpointError: the folder is unreadable, malformed, or does not fit ``model``.
    """
    from recaccel.train.distributed.dist_checkpoint import (
        check_sharded_entries,
        dcp_load,
        read_info,
        verify_sharded,
    )
    from recaccel.train.model.optim import build_dense_optimizer

    info = read_info(path)
    verify_sharded(path)
    reader = safe_dcp_reader(path)
    metadata = reader.read_metadata().state_dict_metadata
    prefix = _embedding_prefix(model)
    expected = model.state_dict()
    if cfg is not None and optimizer is None:
        optimizer = build_dense_optimizer(model, cfg.optim)
    replicated = _replicated_optimizer(path, cfg, model) if cfg is not None else None
    ranks = _ranks(path, info, metadata)
    targets = _tensor_targets(metadata, expected, prefix)
    blobs = {"dense_optim": optimizer, "replicated_optim": replicated}
    targets.update({name: b"" for name, checked in blobs.items() if checked is not None})
    targets.update({f"ranks.{r}": b"" for r in ranks})
    dcp_load(path, targets, reader=reader, no_dist=True)
    check_sharded_entries(path, targets, optimizer, replicated, ranks)
    tensors = {k: v for k, v in targets.items() if isinstance(v, Tensor)}
    state = _single_layout(path, tensors, prefix)
    # The optimizer state the single-process embedding keeps beside its rows is not scored.
    missing = [k for k in expected if k not in state and not _is_table_state(k, expected)]
    if missing:
        raise CheckpointError(path, f"does not fit this run (no entry for {missing[0]!r} of this model)")
    for key, value in expected.items():
        state.setdefault(key, value)
    check_module_state(path, "model", model, state)
    apply_state(path, "model", model.load_state_dict, state)


def _tensor_targets(metadata: dict[str, Any], expected: dict[str, Any], prefix: str) -> dict[str, Tensor]:
    """What to read of the folder's tensors: every dense entry of the model as a resume
    reads it (``model.<k>``, in the model's order: a missing one is named as a resume
    names it), any other ``model.*`` entry, and every table's rows."""
    targets = {
        f"model.{k}": torch.empty(v.shape, dtype=v.dtype)
        for k, v in expected.items()
        if isinstance(v, Tensor) and not k.startswith(prefix)
    }
    for key, meta in metadata.items():
        if key in targets or not hasattr(meta, "size"):  # bytes: blobs, read when checked
            continue
        section, _, rest = key.partition(".")
        if section == "model" or (section in ("embedding", "replicated") and rest.endswith(".weight")):
            targets[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return targets


def _ranks(path: Path, info: dict[str, Any], metadata: dict[str, Any]) -> list[int]:
    """The ranks that wrote the folder, from ``recaccel.json``'s ``world_size``."""
    size = info.get("world_size")
    # Each rank wrote an entry: a count beyond the folder's entries is no world size.
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= len(metadata):
        raise CheckpointError(path / INFO_FILE, f"'world_size' must be a number of ranks, got {show(size)}")
    return list(range(size))


def _replicated_optimizer(path: Path, cfg: Config, model: nn.Module) -> torch.optim.Optimizer | None:
    """The optimizer the run's data-parallel tables had (None: it had none), over fresh
    tables of the same shapes: what the folder's ``replicated_optim`` must fit."""
    from recaccel.models.torchrec_sparse import embedding_tables
    from recaccel.train.distributed.hybrid import replicated_tables
    from recaccel.train.distributed.sharding import table_kinds

    tables = embedding_tables(_sparse_embedding(model))
    kinds = table_kinds(cfg.parallel, [t.name for t in tables])
    local = [t for t in tables if kinds[t.name] == "data_parallel"]
    if not local:
        return None
    try:
        return replicated_tables(local, cfg.optim, torch.device("cpu"))[1]
    except ImportError as e:  # its rule is TorchRec's; scoring itself needs no TorchRec
        logger.warning("%s: entry 'replicated_optim' not checked (%s)", path, first_line(e))
        return None


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


def _sparse_arch_name(model: nn.Module) -> str:
    """The module name of the model's one SparseArch (hybrid mode needs exactly one)."""
    from recaccel.models.arches import SparseArch

    names = [name for name, m in model.named_modules() if isinstance(m, SparseArch)]
    if len(names) != 1:
        raise RecaccelError(
            f"a hybrid checkpoint needs a model with one SparseArch, this one has {len(names)}"
        )
    return names[0]


def _embedding_prefix(model: nn.Module) -> str:
    """The state-dict prefix of the model's one SparseArch embedding (as hybrid mode names it)."""
    name = _sparse_arch_name(model)
    return f"{name}.embedding." if name else "embedding."


def _sparse_embedding(model: nn.Module) -> nn.Module:
    """The embedding module of the model's one SparseArch."""
    return model.get_submodule(_sparse_arch_name(model)).embedding


def _is_table_state(key: str, expected: dict[str, Any]) -> bool:
    """Whether ``key`` is per-table optimizer state (or the rounding state) of the embedding:
    a key ``<prefix><table>.<name>`` other than ``weight`` whose table has a ``weight`` key."""
    stem, _, name = key.rpartition(".")
    return name != "weight" and (f"{stem}.weight" in expected or "rounding" in name)
