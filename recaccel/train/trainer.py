"""The training loop shared by DLRM and meta-DLRM: the objective differs, the loop does not."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from recaccel.config import Config
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.dataset import open_dataset
from recaccel.io.loader import DeviceLoader
from recaccel.io.readers.state import epoch_done, saved_counters, set_counters
from recaccel.models.factory import build_model
from recaccel.train.checkpoint import TrainState, all_checkpoints, load_reader_position
from recaccel.train.data_wait import DataWait
from recaccel.train.objectives import DLRMObjective, MetaObjective, Objective
from recaccel.train.optim import build_dense_optimizer
from recaccel.train.parallel import Parallelism, build_parallel
from recaccel.train.runlog import RunLog, check_run_dir, clear_run

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


def loss_kind(cfg: Config, label_kind: str) -> str:
    """``bce`` for click labels, ``mse`` for ratings (``train.loss = auto`` picks by data)."""
    kind = cfg.train.loss
    if kind == "auto":
        return "bce" if label_kind == "binary" else "mse"
    if kind == "bce" and label_kind != "binary":
        raise ConfigError(f"train.loss=bce needs binary labels; {cfg.data.train} has {label_kind} labels")
    return kind


class Trainer:
    """Trains and evaluates one model as a config describes.

    Args:
        cfg: the resolved config; ``cfg.train.out_dir`` is the run directory.
        resume: continue from the newest checkpoint in the run directory.
        parallel: the process layout (default: one process).
        overwrite: a new run (not ``resume``) may replace the run already in the run
            directory: ``fit`` deletes its checkpoints, log and metrics first.
        fresh_if_no_checkpoint: with ``resume``, a run directory without any checkpoint
            (a run stopped before its first one) trains from step 0 instead of failing.

    Raises:
        RecaccelError: a new run into a run directory that holds another run, without
            ``overwrite``; ``resume`` with ``overwrite``; a checkpoint that cannot be resumed.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        resume: bool = False,
        parallel: Parallelism | None = None,
        overwrite: bool = False,
        fresh_if_no_checkpoint: bool = False,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.train.out_dir)
        if resume and overwrite:
            raise ConfigError("--resume continues the run in the run directory; --overwrite would delete it")
        # Every rank looks before any writes (the first collective comes later).
        self.overwrite = overwrite and not resume
        if not resume:
            check_run_dir(self.run_dir, overwrite=overwrite)
        self.device = resolve_device(cfg.train.device)
        self.parallel = parallel or build_parallel(cfg, self.device)
        self.device = self.parallel.device  # hybrid on CUDA: this rank's GPU
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        # Every generator a checkpoint saves starts seeded, so runs (and their checkpoints)
        # repeat in fresh processes too.
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        self.schema = open_dataset(cfg.data.train).schema
        model = build_model(cfg.model, cfg.optim, self.schema, self.device)
        kind = loss_kind(cfg, self.schema.label_kind)
        objective_type = MetaObjective if cfg.train.mode == "meta" else DLRMObjective
        self.objective: Objective = objective_type(cfg, model, kind)
        # train.eval_tasks: score a plain DLRM like a meta-learner (fine-tuned on each
        # task's support rows, and as is), on the same query rows: the meta baselines.
        plain_on_tasks = cfg.train.eval_tasks and objective_type is DLRMObjective
        self.evaluator: Objective = MetaObjective(cfg, model, kind) if plain_on_tasks else self.objective
        self.module = self.parallel.wrap(self.objective.module)
        self.optimizer = build_dense_optimizer(self.objective.module, cfg.optim)
        self.reader = self._reader(self.objective, cfg.data.train, train=True)
        self.state = TrainState()
        if resume and fresh_if_no_checkpoint and not all_checkpoints(self.run_dir):
            logger.warning("%s has no checkpoint yet: training starts from step 0", self.run_dir)
        elif resume:
            self.state = self.parallel.load_checkpoint(self.run_dir, self.objective.module, self.optimizer)
            logger.info("resumed %s at step %d", self.run_dir, self.state.step)
        # Opened by fit(): evaluating a run's checkpoint must not rewrite its record.
        self.log: RunLog | None = None

    def _reader(self, objective: Objective, path: str, *, train: bool):
        def make(rank: int, world_size: int):
            return objective.reader(path, train=train, rank=rank, world_size=world_size)

        return self.parallel.reader(make, train=train)

    def _event(self, kind: str, **fields: Any) -> None:
        if self.log is not None:
            self.log.event(kind, **fields)

    def train_step(self, batch) -> torch.Tensor:
        """One optimizer step under the process layout (see ``Parallelism.train_step``)."""
        return self.parallel.train_step(self.objective, self.optimizer, batch)

    def _reached_end(self) -> bool:
        t = self.cfg.train
        return self.state.step >= t.steps if t.steps > 0 else self.state.epoch >= t.epochs

    def _total_steps(self) -> int | None:
        t = self.cfg.train
        per_epoch = getattr(self.reader, "num_batches", None)
        return t.steps if t.steps > 0 else (per_epoch * t.epochs if per_epoch else None)

    def _checkpoint(self) -> None:
        self.parallel.save_checkpoint(self.run_dir, self.objective.module, self.optimizer, self.state)

    def fit(self) -> dict[str, Any]:
        """Trains until ``train.steps`` (or ``train.epochs``), evaluates, writes metrics.json
        (and the resolved config.toml and log.jsonl in the run directory)."""
        t = self.cfg.train
        if self.parallel.is_main:
            if self.overwrite:  # before any rank writes: they meet at a collective first
                clear_run(self.run_dir)
            self.log = RunLog(self.run_dir)
            self.log.write_config(self.cfg)
        bar = tqdm(
            total=self._total_steps(),
            initial=self.state.step,
            unit="step",
            disable=not (t.progress and self.parallel.is_main),
        )
        loader = DeviceLoader(
            self.reader, self.device, self.cfg.data.prefetch, backend=self.cfg.data.loader_backend
        )
        wait = DataWait()
        seconds_before = self.state.train_seconds
        stats = getattr(self.reader, "stats", None)
        if self.state.data is not None and stats is not None:  # resumed: counting goes on
            set_counters(stats, self.state.data)
        self.module.train()
        while not self._reached_end():
            self.reader.set_epoch(self.state.epoch)
            finished = False
            if self.state.reader is not None:
                load_reader_position(self.reader, self.state.reader, self.run_dir)
                # Saved after the epoch's last batch: the reader would go on into the next
                # epoch, which this loop counts as the next one. Every rank still joins the
                # (empty) pass, so hybrid ranks agree the epoch is over.
                finished = epoch_done(self.state.reader)
            steps_before = self.state.step
            clock = time.perf_counter()
            # Hybrid: every rank agrees before each step that all ranks have a batch.
            for batch in wait.wrap(self.parallel.batches(() if finished else loader, self.objective)):
                loss = self.train_step(batch)
                self.state.step += 1
                self.state.samples += self.parallel.step_rows
                self.state.reader = loader.state_dict()
                self.state.data = self._counters(self.state.reader)
                bar.update(1)
                if self.state.step % t.log_every == 0 or self.state.step == 1:
                    self.state.last_loss = float(loss)
                    bar.set_postfix(loss=f"{self.state.last_loss:.4f}")
                    self._event(
                        "train", step=self.state.step, epoch=self.state.epoch, loss=self.state.last_loss
                    )
                if t.checkpoint_every > 0 and self.state.step % t.checkpoint_every == 0:
                    self._checkpoint()
                if t.eval_every > 0 and self.state.step % t.eval_every == 0:
                    # Evaluation time is not training time.
                    self.state.train_seconds += time.perf_counter() - clock
                    self._event("eval", step=self.state.step, **self.evaluate())
                    self.module.train()
                    clock = time.perf_counter()
                if self._reached_end():
                    break
            self.state.train_seconds += time.perf_counter() - clock
            if self.state.step == steps_before and self.state.reader is None:
                raise DataError(f"no training batch could be formed from {self.cfg.data.train}")
            if not (t.steps > 0 and self.state.step >= t.steps):
                self.state.epoch += 1
                self.state.reader = None
        bar.close()
        self._checkpoint()
        metrics = self.evaluate_all()
        metrics.update(
            steps=self.state.step,
            epochs=self.state.epoch,
            train_samples=self.state.samples,
            samples_per_s=self.state.samples / max(self.state.train_seconds, 1e-9),
            train_loss=self.state.last_loss,
            data_wait_s=wait.seconds,
            data_startup_s=wait.startup_seconds,
            data_wait_fraction=wait.fraction(self.state.train_seconds - seconds_before),
            data=dict(self.state.data) if self.state.data is not None else dict(stats or {}),
        )
        self._event("final", **metrics)
        if self.log is not None:
            self.log.write_metrics(metrics)
            self.log.close()
        self.parallel.close()  # hybrid: leaves the process group only if it started it
        return metrics

    def _counters(self, position: dict[str, Any]) -> dict[str, int]:
        """The reader counters as of the last trained batch: those paired with its position
        (the loader reads ahead), else the reader's own."""
        paired = saved_counters(position)
        return paired if paired is not None else dict(getattr(self.reader, "stats", {}))

    def evaluate(self, path: str | None = None) -> dict[str, Any]:
        """Metrics of the current model on ``path`` (default ``data.test``)."""
        path = path or self.cfg.data.test
        reader = self._reader(self.evaluator, path, train=False)
        self.module.eval()
        batches = DeviceLoader(
            reader, self.device, self.cfg.data.prefetch, backend=self.cfg.data.loader_backend
        )
        if isinstance(self.evaluator, DLRMObjective):
            logits, labels = self.evaluator.predictions(batches)
            logits, labels = self.parallel.gather(logits), self.parallel.gather(labels)
            if labels.numel() == 0:
                raise DataError(f"evaluation data {path} has no rows")
            return self.evaluator.metrics(logits, labels)
        return self.evaluator.evaluate(batches)

    def evaluate_all(self) -> dict[str, Any]:
        """Metrics on data.test at the top level; with ``meta.eval_states`` (``name=path``)
        also one entry per state under ``states``, data.test's named after its folder."""
        metrics = self.evaluate()
        if self.cfg.meta.eval_states:
            states = {Path(self.cfg.data.test).name: dict(metrics)}
            for spec in self.cfg.meta.eval_states:
                name, sep, path = spec.partition("=")
                if not sep or not name or not path:
                    raise ConfigError(f"meta.eval_states entry {spec!r} must look like name=path")
                states[name] = self.evaluate(path)
            metrics["states"] = states
        return metrics
