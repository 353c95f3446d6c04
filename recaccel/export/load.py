"""A run's trained model, read back from one of its checkpoints for export.

The model is rebuilt on the CPU with the reference backends (plain PyTorch, no Triton
or FBGEMM kernels), every table in memory: what an exporter traces or copies. A hybrid
run's sharded checkpoint is read whole (its tables must fit this host's memory).

Shapes: F sparse fields, R rows of a table, D embedding dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from recaccel.api import run_config
from recaccel.config import Config
from recaccel.errors import ConfigError, RecaccelError
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import PerTableEmbeddingBag
from recaccel.train.checkpoint.payload import (
    STATE_KEYS,
    apply_state,
    check_entries,
    check_module_state,
    read_payload,
)
from recaccel.train.evaluation.from_checkpoint import checkpoint_step, load_sharded_model, pick_checkpoint
from recaccel.train.run.runlog import CONFIG_FILE


@dataclass
class LoadedRun:
    """A trained model and what an export says about it.

    Attributes:
        cfg: the run's config (``run_dir/config.toml``).
        model: the global model (a DLRM, DLRM-DCN or MeLU) in eval mode on the CPU; for a
            meta run the meta-learned initialization, before any per-task adaptation.
        checkpoint: the checkpoint file read.
        step: its training step.
        fields: the F sparse fields (name, cardinality), in the model's field order.
        num_dense: Dd.
        label_kind: ``binary`` (the model's output is a logit) or ``rating``.
    """

    cfg: Config
    model: DLRM
    checkpoint: Path
    step: int
    fields: list[tuple[str, int]]
    num_dense: int
    label_kind: str

    @property
    def arch(self) -> str:
        """``dlrm`` (dot interaction), ``dlrm_dcn`` or ``melu``."""
        if self.cfg.model.arch == "melu":
            return "melu"
        return "dlrm_dcn" if self.cfg.model.interaction == "dcnv2" else "dlrm"

    def table_weights(self) -> dict[str, Tensor]:
        """Each field's table [R, D] in float32 (16-bit rows widened exactly), by field name,
        in field order."""
        embedding = self.model.sparse_arch.embedding
        if isinstance(embedding, PerTableEmbeddingBag):
            weights = {name: bag.weight for name, bag in zip(embedding.features, embedding.bags)}
        else:
            weights = {name: state["weight"] for name, state in embedding.table_states().items()}
        return {name: weights[name].detach().float().clone() for name, _ in self.fields}


def load_run(run_dir: str | Path, step: int | None = None) -> LoadedRun:
    """Rebuilds a run's model from its newest checkpoint (or the one of ``step``): a
    single-process ``step-*.pt`` file, or a hybrid run's ``step-*.dcp`` folder read whole.

    Args:
        run_dir: a run directory (config.toml, checkpoints/).
        step: the checkpoint's training step; None = the newest.

    Raises:
        RecaccelError: no such run, no (such) checkpoint, or a checkpoint that does not
            fit the run's model (one line naming it).
    """
    run_dir = Path(run_dir)
    path = pick_checkpoint(run_dir, step)
    config_file = run_dir / CONFIG_FILE
    if not config_file.is_file():
        raise RecaccelError(f"{run_dir} is not a recaccel run directory (it has no {CONFIG_FILE})")
    cfg = run_config(run_dir)  # as recaccel-eval and a resume read it
    schema = run_schema(cfg)
    model = build_cpu_model(cfg, schema)
    module = _checkpointed_module(cfg, model, schema.label_kind)
    if path.suffix == ".dcp":
        # A hybrid run's shards, each table read whole, checked as a resume checks them.
        load_sharded_model(path, module, cfg)
    else:
        _load_model_file(path, module)
    model.eval()
    return LoadedRun(
        cfg=cfg,
        model=model,
        checkpoint=path,
        step=checkpoint_step(path),
        fields=[(f.name, f.cardinality) for f in schema.sparse],
        num_dense=schema.num_dense,
        label_kind=schema.label_kind,
    )


def run_schema(cfg: Config):
    """The feature schema the run trained on, as the trainer reads it: the training data's
    footers, or its ``[data.schema]`` mapping."""
    from recaccel.io.format.dataset import open_dataset

    return open_dataset(cfg.data.train, cfg.data.schema).schema


def build_cpu_model(cfg: Config, schema) -> DLRM:
    """The run's model on the CPU: reference kernels, every table in memory, no cache.

    The embedding keeps the run's optimizer (its checkpoint holds that state too) and
    row dtype; ``per_table`` stays ``per_table`` (its checkpoint keys differ).
    """
    from recaccel.models.factory import build_model

    model_cfg = cfg.model
    backend = "per_table" if model_cfg.embedding_backend == "per_table" else "reference"
    model_cfg = dataclasses.replace(
        model_cfg,
        embedding_backend=backend,
        interaction_backend="reference",
        embedding_placement="device",
        table_placement=[],
    )
    return build_model(model_cfg, cfg.optim, schema, torch.device("cpu"))


def _checkpointed_module(cfg: Config, model: DLRM, label_kind: str) -> nn.Module:
    """What the run's checkpoints hold the state of: the model, or for a meta run the
    meta-learner around it (the model under ``model.``, learned inner rates beside)."""
    if cfg.train.mode != "meta":
        return model
    from recaccel.meta.learner import MetaLearner
    from recaccel.train.loop.trainer import resolve_loss

    loss = resolve_loss(cfg, label_kind)
    return MetaLearner(model, cfg.meta, loss=loss, engine=cfg.meta.engine)


def _load_model_file(path: Path, module: nn.Module) -> None:
    """The ``model`` entry of a ``step-*.pt`` checkpoint into ``module``, checked first
    (the file is untrusted: read restricted to tensors, numbers, strings and containers).

    Raises:
        CheckpointError: one line naming the checkpoint and its first problem.
    """
    payload = read_payload(path, path, "cpu")
    check_entries(path, payload, ("model", *STATE_KEYS))
    check_module_state(path, "model", module, payload["model"])
    apply_state(path, "model", module.load_state_dict, payload["model"])


def check_arch(loaded: LoadedRun, supported: tuple[str, ...], fmt: str) -> None:
    """Refuses a model ``--format fmt`` cannot express.

    Raises:
        ConfigError: naming model.arch / model.interaction and the supported ones.
    """
    if loaded.arch not in supported:
        what = f"model.arch={loaded.cfg.model.arch}"
        if loaded.cfg.model.arch != "melu":
            what += f" with model.interaction={loaded.cfg.model.interaction}"
        raise ConfigError(f"--format {fmt} exports {' and '.join(supported)} models; this run is {what}")
