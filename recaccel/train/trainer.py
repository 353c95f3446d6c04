"""The training loop shared by DLRM (and, through its step, meta-DLRM)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from recaccel.config import Config
from recaccel.errors import ConfigError, DataError
from recaccel.io.batch import Batch
from recaccel.io.loader import DeviceLoader
from recaccel.io.dataset import open_dataset
from recaccel.io.parquet import BatchReader
from recaccel.models.factory import build_model
from recaccel.train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from recaccel.train.evaluation import binary_metrics, predict, rating_metrics
from recaccel.train.optim import build_dense_optimizer
from recaccel.train.runlog import RunLog

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


class Trainer:
    """Trains and evaluates one model as a config describes.

    Args:
        cfg: the resolved config; ``cfg.train.out_dir`` is the run directory.
        resume: continue from the newest checkpoint in the run directory.
    """

    def __init__(self, cfg: Config, *, resume: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.train.out_dir)
        self.device = resolve_device(cfg.train.device)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.train.seed)
        self.schema = open_dataset(cfg.data.train).schema
        self.loss_kind = self._loss_kind()
        self.model = build_model(cfg.model, cfg.optim, self.schema, self.device)
        self.optimizer = build_dense_optimizer(self.model, cfg.optim)
        self.reader = BatchReader.from_config(cfg.data.train, cfg.data, train=True)
        self.state = TrainState()
        if resume:
            self.state = load_checkpoint(self.run_dir, self.model, self.optimizer, self.device)
            logger.info("resumed %s at step %d", self.run_dir, self.state.step)
        self.log = RunLog(self.run_dir)
        self.log.write_config(cfg)

    def _loss_kind(self) -> str:
        kind = self.cfg.train.loss
        if kind == "auto":
            return "bce" if self.schema.label_kind == "binary" else "mse"
        if kind not in ("bce", "mse"):
            raise ConfigError(f"train.loss must be auto, bce or mse, got {kind!r}")
        if kind == "bce" and self.schema.label_kind != "binary":
            raise ConfigError(f"train.loss=bce needs binary labels; {self.cfg.data.train} has rating labels")
        return kind

    def loss(self, logits: Tensor, batch: Batch) -> Tensor:
        if self.loss_kind == "bce":
            return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, weight=batch.weights)
        err = (logits - batch.labels).pow(2)
        return err.mean() if batch.weights is None else (err * batch.weights).sum() / batch.weights.sum()

    def train_step(self, batch: Batch) -> Tensor:
        """One optimizer step; the sparse update happens inside backward."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.model(batch), batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _done(self) -> bool:
        t = self.cfg.train
        return (t.steps > 0 and self.state.step >= t.steps) or (t.steps <= 0 and self.state.epoch >= t.epochs)

    def _total_steps(self) -> int | None:
        t = self.cfg.train
        if t.steps > 0:
            return t.steps
        per_epoch = getattr(self.reader, "num_batches", None)
        return per_epoch * t.epochs if per_epoch is not None else None

    def fit(self) -> dict[str, Any]:
        """Trains until ``train.steps`` (or ``train.epochs``), evaluates, writes metrics.json."""
        t = self.cfg.train
        bar = tqdm(total=self._total_steps(), initial=self.state.step, disable=not t.progress, unit="step")
        loader = DeviceLoader(self.reader, self.device, self.cfg.data.prefetch)
        last_loss = math.nan
        self.model.train()
        while not self._done():
            self.reader.set_epoch(self.state.epoch)
            if self.state.reader is not None:
                self.reader.load_state_dict(self.state.reader)
            started = time.perf_counter()
            for batch in loader:
                loss = self.train_step(batch)
                self.state.step += 1
                self.state.samples += batch.batch_size
                self.state.reader = loader.state_dict()
                bar.update(1)
                if self.state.step % t.log_every == 0 or self.state.step == 1:
                    last_loss = float(loss)
                    self.state.train_seconds += time.perf_counter() - started
                    started = time.perf_counter()
                    bar.set_postfix(loss=f"{last_loss:.4f}")
                    self.log.event("train", step=self.state.step, epoch=self.state.epoch, loss=last_loss,
                                   samples_per_s=self.state.samples / max(self.state.train_seconds, 1e-9))
                if t.checkpoint_every > 0 and self.state.step % t.checkpoint_every == 0:
                    self.state.train_seconds += time.perf_counter() - started
                    started = time.perf_counter()
                    save_checkpoint(self.run_dir, self.model, self.optimizer, self.state)
                if t.eval_every > 0 and self.state.step % t.eval_every == 0:
                    self.log.event("eval", step=self.state.step, **self.evaluate())
                    self.model.train()
                    started = time.perf_counter()
                if self._done():
                    break
            self.state.train_seconds += time.perf_counter() - started
            if not (t.steps > 0 and self.state.step >= t.steps):
                self.state.epoch += 1
                self.state.reader = None
            if self.state.step == 0:
                raise DataError(f"no training batch could be formed from {self.cfg.data.train}")
        bar.close()
        save_checkpoint(self.run_dir, self.model, self.optimizer, self.state)
        metrics = self.evaluate()
        metrics.update(
            steps=self.state.step,
            epochs=self.state.epoch,
            train_samples=self.state.samples,
            samples_per_s=self.state.samples / max(self.state.train_seconds, 1e-9),
            train_loss=last_loss,
            data=dict(getattr(self.reader, "stats", {})),
        )
        self.log.event("final", **metrics)
        self.log.write_metrics(metrics)
        self.log.close()
        return metrics

    def evaluate(self, path: str | None = None) -> dict[str, Any]:
        """Metrics of the current model on ``path`` (default ``data.test``)."""
        path = path or self.cfg.data.test
        reader = BatchReader.from_config(path, self.cfg.data, train=False)
        self.model.eval()
        logits, labels = predict(self.model, DeviceLoader(reader, self.device, self.cfg.data.prefetch))
        if labels.numel() == 0:
            raise DataError(f"evaluation data {path} has no rows")
        if self.loss_kind == "bce":
            return binary_metrics(logits, labels)
        return rating_metrics(logits, labels)
