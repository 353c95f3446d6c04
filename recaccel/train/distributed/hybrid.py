"""Hybrid parallelism: embeddings sharded by TorchRec, dense layers data-parallel.

One process per device under torchrun (:mod:`recaccel.train.distributed.launch`).
:class:`HybridParallel` is the Trainer's ``Parallelism`` and keeps sharding, batch
slicing and gradient sync; the rest lives beside it: the process group (``group``), the
model checks (``hybrid_setup``), the per-step agreement (``lockstep``), the straggler
policies (``straggler/``), the monitor (``monitor``), TorchRec's pipelines
(``hybrid_pipeline``) and sharded checkpoints (``dist_checkpoint``).

A step: every rank agrees the step goes on (a small allreduce, also carrying the global
loss normaliser, timings and stop signals), trains its batch (the sharded lookup
exchanges ids and pooled embeddings by all-to-all; FBGEMM applies the sparse update on
each shard in backward), its loss scaled to its share of the global mean, then one
bucketed allreduce of the dense gradients and the dense optimizer step. A failed or
timed-out collective raises :class:`CollectiveError` on the surviving ranks (one line).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from recaccel.config import Config, TrainConfig
from recaccel.config.rules import check_rule
from recaccel.io.readers.protocol import Reader
from recaccel.train.checkpoint.state import TrainState
from recaccel.train.distributed.collectives import CollectiveError
from recaccel.train.distributed.dense_sync import DenseGradSync, flat_collective
from recaccel.train.distributed.group import Group
from recaccel.train.distributed.hybrid_data import rank_reader, units
from recaccel.train.distributed.hybrid_setup import check_hybrid_step, sparse_arch_tables
from recaccel.train.distributed.lockstep import Lockstep
from recaccel.train.distributed.lookup import GuardedLookup
from recaccel.train.distributed.monitor import Monitor, check_faults
from recaccel.train.distributed.replicated import replicated_tables
from recaccel.train.distributed.shard_service import gathered_ledger
from recaccel.train.distributed.straggler import build_policy, check_plan_kinds, check_straggler
from recaccel.train.loop.observers import StepDone, StepObserver, StepObservers
from recaccel.train.loop.parallel import BatchWithState
from recaccel.train.loop.preemption import pending_signal
from recaccel.train.loop.schedule import set_fused_rate, set_group_rates
from recaccel.train.model.objectives import Objective, loss_denominator

logger = logging.getLogger(__name__)

__all__ = ["CollectiveError", "HybridParallel"]


class HybridParallel:
    """TorchRec model parallelism for embeddings, data parallelism for the rest.

    Args:
        cfg: the run config (``parallel``, ``optim``, ``data`` are read).
        device: the device kind (a CUDA device becomes ``cuda:LOCAL_RANK``).

    Raises:
        ConfigError: not launched by torchrun, or an unsupported backend/device/data setting.
    """

    def __init__(self, cfg: Config, device: torch.device) -> None:
        self.cfg = cfg
        check_rule(cfg, "hybrid_needs_drop_last")  # a config changed after it was loaded
        self.group = Group(cfg.parallel, device)
        self.device, self.rank, self.world_size = self.group.device, self.group.rank, self.group.world_size
        self.collectives = self.group.collectives
        self.gather = self.group.gather
        check_faults(cfg, self.world_size)
        check_straggler(cfg)
        # parallel.straggler: how the batch is split, decided alike on all ranks.
        self.straggler = build_policy(cfg, self.rank, self.world_size)
        self.lockstep = Lockstep(self.rank, self.world_size)
        self._dynamic_reader = None  # parallel.data=dynamic: this rank's shard reader
        # Step and collective timings (monitor.every > 0), and fault.slow_rank's sleep.
        self.monitor = Monitor(cfg.monitor, cfg.fault, self.rank, self.world_size, self.group.comm_device)
        self.group.absent = self.monitor.absent
        self.group.wait_for_all(cfg.parallel.timeout_s)
        self.embedding = None  # the TorchRecEmbedding after wrap()
        self.dmp = None
        self.plan = None
        self.replicated = None  # data-parallel tables (recaccel embedding, autograd mode)
        self.replicated_optimizer: torch.optim.Optimizer | None = None
        self.embedding_prefix = ""
        self._sync: DenseGradSync | None = None
        self._step_denominator = 1.0
        self.step_rows = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def observers(self) -> list[StepObserver]:
        """The straggler policy and the communication monitor (in that order)."""
        return [self.straggler, self.monitor]

    def sparse_rate_setters(self) -> list[Callable[[float], None]]:
        """Setters of the sharded tables' fused optimizer rate and the replicated tables'."""
        setters: list[Callable[[float], None]] = []
        if self.dmp is not None:
            setters.append(partial(set_fused_rate, self.dmp.fused_optimizer))
        if self.replicated_optimizer is not None:
            setters.append(partial(set_group_rates, self.replicated_optimizer))
        return setters

    def wrap(self, module: nn.Module) -> nn.Module:
        """Moves the SparseArch's embedding into TorchRec (sharded) in place; returns ``module``.

        Raises:
            ConfigError: TorchRec is missing, the module has no (or several) SparseArch, or
                unsupported tables.
        """
        from recaccel.models.torchrec_sparse import TorchRecEmbedding, load_table_weights
        from recaccel.train.distributed.sharding import plan_rows, shard_tables, table_kinds

        found = sparse_arch_tables(module)
        self.embedding_prefix, tables, weights = found.prefix, found.tables, found.weights
        kinds = table_kinds(self.cfg.parallel, [t.name for t in tables])
        sharded = [t for t in tables if kinds[t.name] != "data_parallel"]
        local = [t for t in tables if kinds[t.name] == "data_parallel"]
        with self.collectives("sharding the embedding tables"):
            if sharded:
                self.dmp, self.plan = shard_tables(
                    sharded, kinds, self.cfg.optim, self.device, self.group.local_world_size
                )
                load_table_weights(self.dmp.state_dict(), {t.name: weights[t.name] for t in sharded})
            if local:
                self.replicated, self.replicated_optimizer = replicated_tables(
                    local, self.cfg.optim, self.device, weights
                )
            found.arch.embedding = TorchRecEmbedding(
                GuardedLookup(self.dmp, self) if self.dmp is not None else None,
                [f for t in tables for f in t.features],
                found.dim,
                replicated=self.replicated,
                replicated_features=[f for t in local for f in t.features],
                register=False,
            )
            self.embedding = found.arch.embedding
            self._broadcast(module)
        if self.plan is not None:
            check_plan_kinds(self.straggler.policy, {r["table"]: r["sharding"] for r in plan_rows(self.plan)})
            if self.is_main:
                logger.info("embedding sharding plan:\n%s", self.plan)
        return module

    def _broadcast(self, module: nn.Module) -> None:
        """Makes every rank's dense parameters and buffers rank 0's (one broadcast per dtype)."""
        tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.numel()]
        if self.replicated is not None:
            tensors += list(self.replicated.parameters())
        flat_collective(tensors, lambda flat: dist.broadcast(flat, src=0))

    def reader(self, make: Callable[[int, int], Reader], *, train: bool) -> Reader:
        """This rank's reader (:func:`~recaccel.train.distributed.hybrid_data.rank_reader`)."""
        reader = rank_reader(make, self.cfg, self.rank, self.world_size, self.straggler, train=train)
        if train and self.cfg.parallel.data == "dynamic":
            self._dynamic_reader = reader  # backup: its batch size follows the split
        return reader

    def steps(
        self,
        source: Iterable[BatchWithState],
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        train: TrainConfig,
        observers: StepObservers | None = None,
    ) -> Iterator[StepDone]:
        """This rank's batches, one hybrid step each: :meth:`batches` and :meth:`train_step`
        (``train.pipeline = "off"``, ``observers.before_step`` before each), or TorchRec's
        train pipeline over the sharded model (``sync`` / ``semi_sync``, see
        :mod:`recaccel.train.distributed.hybrid_pipeline`).

        Raises:
            ConfigError: see :func:`~recaccel.train.distributed.hybrid_setup.check_hybrid_step`,
                or a pipeline this setup cannot run.
        """
        check_hybrid_step(train)
        if train.pipeline != "off":
            from recaccel.train.distributed.hybrid_pipeline import pipelined_steps

            yield from pipelined_steps(self, source, objective, optimizer, train.pipeline)
            return
        position: dict[str, Any] = {}

        def batches() -> Iterator[Any]:
            for batch, state in source:
                position["state"] = state
                yield batch

        for batch in self.batches(batches(), objective):
            if observers is not None:
                observers.before_step(batch)
            loss = self.train_step(objective, optimizer, batch)
            yield StepDone(loss, position["state"], self.step_rows)

    def batches(self, loader: Iterable, objective: Objective) -> Iterator:
        """The loader's batches for as long as the ranks agree on a step.

        Before each step :meth:`agree` tells every rank whether the step goes on and the
        global normaliser (:attr:`step_rows` gets the global row count). A rank that runs
        dry still joins it, so all stop together; the straggler policy says what this rank
        trains of the agreed step (its slice, or an empty batch while others finish).
        """
        items = iter(loader)
        while True:
            batch = next(items, None)
            self.straggler.seen(batch)
            agreed = self.agree(batch, objective)
            if agreed is None:
                return
            self._step_denominator, self.step_rows = agreed
            yield self.straggler.local_batch(batch)

    def agree(self, batch: Any | None, objective: Objective) -> tuple[float, int] | None:
        """One allreduce of the :class:`~recaccel.train.distributed.lockstep.Lockstep` slots:
        who has a batch, the global normaliser and rows, each rank's last step timing (fed
        to the straggler policy) and the stop signals ranks got.

        Args:
            batch: this rank's next batch, or None when it has run dry.
            objective: the objective (its loss kind sets the normaliser).

        Returns:
            The global (loss normaliser, training rows), or None when the epoch ends (the
            straggler policy says when: some rank has no batch, ``backup``: every rank).
        """
        counted = batch is not None and self.straggler.counts_normaliser()
        normaliser = (loss_denominator(batch, objective.loss), batch.training_rows) if counted else None
        self.monitor.start_step()
        with (
            self.collectives("agreeing on the next step"),
            self.monitor.collective("agree", self.lockstep.nbytes),
        ):
            agreed = self.lockstep.exchange(
                batch is not None, normaliser, pending_signal(), self.group.comm_device
            )
        if self.straggler.observe(agreed.compute_s, agreed.units) and self._dynamic_reader is not None:
            # backup: a new split sets this rank's next batch size (batches already cut keep theirs)
            self._dynamic_reader.batch_rows = self.straggler.local_rows(self.cfg.data.batch_size)
        if not self.straggler.goes_on(agreed.ready, batch is not None):
            self.monitor.drop_step()  # no step follows this agreement
            if batch is not None:
                logger.info("rank %d: another rank ran out of batches; ending the epoch", self.rank)
            return None
        return agreed.denominator, agreed.rows

    def stop_requested(self) -> str | None:
        """The stop signal some rank got, as of the last agreement (the same on every rank,
        whichever rank got it and when)."""
        return self.lockstep.stop

    def dense_parameters(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """Parameters whose gradients are summed over ranks: the dense optimizer's and the
        data-parallel tables'."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.replicated is not None:
            params += list(self.replicated.parameters())
        return params

    def train_step(self, objective: Objective, optimizer: torch.optim.Optimizer, batch: Any) -> Tensor:
        """One hybrid step on this rank's batch; returns the global mean loss (detached).

        Call inside :meth:`batches` (it sets this step's global normaliser).
        """
        self.zero_grad(optimizer)
        trained = units(batch)
        with self.collectives("the training step"):
            loss = objective.batch_loss(batch)
            share = loss_denominator(batch, objective.loss) / max(self._step_denominator, 1e-12)
            if not trained:  # backup's dry rank: joins the collectives, adds nothing (its mean is 0/0)
                loss = loss.nan_to_num(0.0)
            scaled = loss * share
            scaled.backward()
        total = self.sync_and_step(optimizer, scaled.detach())
        self.lockstep.trained(self.monitor.last_compute_s, trained)  # for the next agreement
        return total

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clears the dense and the replicated tables' gradients."""
        optimizer.zero_grad(set_to_none=True)
        if self.replicated_optimizer is not None:
            self.replicated_optimizer.zero_grad(set_to_none=True)

    def sync_and_step(self, optimizer: torch.optim.Optimizer, share: Tensor) -> Tensor:
        """After backward: one bucketed allreduce of the dense gradients and this rank's
        loss share, then the dense and replicated-table optimizer steps.

        Args:
            optimizer: the dense optimizer.
            share: this rank's share of the global mean loss (a detached scalar or [1]).

        Returns:
            The global mean loss of the step (a scalar).
        """
        if self._sync is None:
            self._sync = DenseGradSync(self.dense_parameters(optimizer))
        self.monitor.after_compute()
        nbytes = sum(p.grad.nbytes for p in self._sync.params if p.grad is not None) + 4
        with self.collectives("the training step"), self.monitor.collective("dense_sync", nbytes):
            total = self._sync.allreduce(share.reshape(1).float())
        optimizer.step()
        if self.replicated_optimizer is not None:
            self.replicated_optimizer.step()
        if self.monitor.end_step():
            with self.collectives("the monitor's gather"):
                self.monitor.gather()
        return total[0]

    def save_checkpoint(
        self,
        run_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        keep: int = 2,
    ) -> Path:
        """Writes a sharded checkpoint of the run (every rank calls it), keeping the newest ``keep``."""
        from recaccel.train.distributed.dist_checkpoint import save_sharded

        with self.collectives("writing a checkpoint"):
            if self.cfg.parallel.data == "dynamic" and state.reader is not None:
                state = dataclasses.replace(state, reader=gathered_ledger(state.reader, self.world_size))
            return save_sharded(run_dir, self, model, optimizer, state, keep)

    def load_checkpoint(
        self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> TrainState:
        """Restores the newest sharded checkpoint of the run (every rank calls it)."""
        from recaccel.train.distributed.dist_checkpoint import load_sharded

        with self.collectives("reading a checkpoint"):
            return load_sharded(run_dir, self, model, optimizer)

    def step_figures(self) -> dict[str, Any]:
        return {}  # hybrid steps are eager (the config refuses CUDA graphs here)

    def close(self) -> None:
        """Leaves the process group if this object joined it."""
        self.group.close()
