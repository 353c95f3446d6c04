"""What a Trainer builds before its first step: the device, the process layout, the
objectives and the seeded generators, each from the config."""

from __future__ import annotations

import dataclasses
import logging
import os
import random

import numpy as np
import torch

from recaccel.config import Config, LabelKind, Loss, TrainConfig
from recaccel.config.rules import check_rule
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.readers.options import auto_workers
from recaccel.models.factory import build_model
from recaccel.train.distributed.monitor import check_faults
from recaccel.train.loop.parallel import Parallelism, SingleProcess
from recaccel.train.model.dense_head import build_head, check_head_options
from recaccel.train.model.objectives import DLRMObjective, MetaObjective, Objective
from recaccel.train.model.user_model import ModelSource, build_user_model

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA device is available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"train.device={name!r} is not a device name (auto, cpu, cuda)") from None


def with_reader_workers(cfg: Config, device: torch.device, rows: int | None = None) -> Config:
    """``cfg`` with ``data.workers = "auto"`` resolved for ``device``, the host's ranks
    (``LOCAL_WORLD_SIZE``) and the training data's ``rows`` (in shuffle buffers), logged
    once; so the run's config.toml records the count."""
    if cfg.data.workers != "auto":
        return cfg
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    buffers = None if rows is None else -(-rows // cfg.data.shuffle_buffer_rows)
    workers = auto_workers("auto", device.type, local_ranks, buffers)
    logger.info("data.workers = auto: %d reader process(es) on %s", workers, device)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=workers))


def resolve_loss(cfg: Config, label_kind: LabelKind) -> Loss:
    """``bce`` for click labels, ``mse`` for ratings (``train.loss = auto`` picks by data)."""
    loss = cfg.train.loss
    if loss == "auto":
        return "bce" if label_kind == "binary" else "mse"
    if loss == "bce" and label_kind != "binary":
        raise ConfigError(f"train.loss=bce needs binary labels; {cfg.data.train} has {label_kind} labels")
    return loss


def build_parallel(cfg: Config, device: torch.device) -> Parallelism:
    """The process layout ``cfg.parallel.mode`` asks for.

    Raises:
        ConfigError: ``single`` mode in a multi-process launch.
    """
    if cfg.parallel.mode == "hybrid":
        from recaccel.train.distributed.hybrid import HybridParallel

        check_rule(cfg, "hybrid_keeps_no_best_checkpoint")  # a config changed after it was loaded
        return HybridParallel(cfg, device)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise ConfigError(
            f"{world} processes were launched but parallel.mode=single; set parallel.mode=hybrid"
        )
    if cfg.parallel.data == "dynamic":
        raise ConfigError("config key parallel.data=dynamic needs parallel.mode=hybrid")
    if cfg.parallel.straggler != "off":
        raise ConfigError(
            f"config key parallel.straggler={cfg.parallel.straggler} needs parallel.mode=hybrid"
        )
    check_faults(cfg, 1)
    return SingleProcess(device)


def seed_generators(train: TrainConfig) -> None:
    """Seeds every generator a checkpoint saves, so runs (and their checkpoints) repeat
    in fresh processes too."""
    if train.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(train.seed)
    random.seed(train.seed)
    np.random.seed(train.seed)


def build_objectives(
    cfg: Config, schema: FeatureSchema, device: torch.device, source: ModelSource | None
) -> tuple[Objective, Objective]:
    """The training objective and the one evaluation runs, over ``source``'s model (one's
    own) or ``[model]``'s.

    ``train.eval_tasks`` scores a plain DLRM like a meta-learner (fine-tuned on each
    task's support rows, and as is), on the same query rows: the meta baselines.
    """
    check_rule(cfg, "hybrid_places_no_table_on_host")
    if source is not None:
        model = build_user_model(source, cfg, schema, device)
    else:
        model = build_model(cfg.model, cfg.optim, schema, device)
    loss = resolve_loss(cfg, schema.label_kind)
    check_head_options(cfg.train, model, device)
    if cfg.train.mode == "meta":
        objective = MetaObjective(cfg, model, loss)
        return objective, objective
    objective = DLRMObjective(cfg, model, loss, head=build_head(model, cfg.train, device))
    return objective, (MetaObjective(cfg, model, loss) if cfg.train.eval_tasks else objective)
