"""Hybrid parallelism: embeddings sharded by TorchRec, dense layers data-parallel.

One process per device, launched by torchrun (``recaccel-train --nproc N`` re-executes
itself through it, see :mod:`recaccel.train.distributed.launch`). :class:`HybridParallel` implements
the :class:`~recaccel.train.parallel.Parallelism` protocol plus the hooks the
:class:`~recaccel.train.trainer.Trainer` calls in hybrid mode:

- ``wrap``: the model's SparseArch embedding moves into a TorchRec
  ``EmbeddingBagCollection`` sharded by ``DistributedModelParallel`` (see
  :mod:`recaccel.train.distributed.sharding`), starting from the model's own initial rows; tables
  marked ``data_parallel`` stay in a replicated recaccel embedding. Dense parameters
  are broadcast from rank 0.
- ``reader`` / ``batches``: each rank's data (see :mod:`recaccel.train.distributed.hybrid_data`);
  before every step one small allreduce agrees that every rank has a batch (all ranks
  stop at the same step even when their shards differ in length), whether any rank got
  a stop signal (all then stop after the same step, :mod:`recaccel.train.preemption`),
  and sums the loss normalisers and row counts.
- ``train_step``: local forward (the sharded lookup exchanges ids and pooled embeddings
  by all-to-all), the local loss scaled to its share of the global mean, backward (the
  pooled-embedding gradients travel back and FBGEMM applies the sparse optimizer on
  each shard), one bucketed allreduce of the dense gradients (:mod:`recaccel.train.distributed.dense_sync`),
  the dense optimizer step. A meta step is the same: MAML's inner loop runs on the
  local tasks with the replicated head parameters and issues no collective.
- ``gather``: predictions of all ranks for evaluation metrics.
- ``save_checkpoint`` / ``load_checkpoint``: sharded checkpoints (:mod:`recaccel.train.distributed.dist_checkpoint`).

Failure. Collectives time out after ``parallel.timeout_s``; a peer that dies breaks
its connections at once. Either way the surviving ranks raise :class:`CollectiveError`
(a :class:`~recaccel.errors.RecaccelError`: the CLI prints it on one line and exits 2);
with ``monitor.every > 0`` it names the ranks that never arrived at the collective
(:mod:`recaccel.train.distributed.monitor`, which also times every step's compute and
collectives). With NCCL, PyTorch's watchdog aborts a rank whose collective times out.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from recaccel.config import Config, OptimConfig, SparseOptimizer, TrainConfig
from recaccel.config.rules import check_rule
from recaccel.errors import ConfigError
from recaccel.io.readers.protocol import Reader
from recaccel.ops.embedding.specs import SparseOptimConfig
from recaccel.train.checkpoint import TrainState
from recaccel.train.distributed.collectives import CollectiveError, is_comm_error
from recaccel.train.distributed.dense_sync import DenseGradSync, flat_collective
from recaccel.train.distributed.hybrid_data import GlobalSlices, slice_units, units
from recaccel.train.distributed.launch import under_torchrun
from recaccel.train.distributed.monitor import Monitor, check_faults
from recaccel.train.distributed.straggler import SplitController, check_plan_kinds, check_straggler
from recaccel.train.objectives import Objective, loss_denominator
from recaccel.train.parallel import BatchWithState, StepDone
from recaccel.train.preemption import STOP_SIGNALS, pending_signal

logger = logging.getLogger(__name__)

# The sparse rules a replicated table can run (as torch optimizers on dense gradients).
_REPLICATED_OPTIMIZERS: tuple[SparseOptimizer, ...] = ("sgd", "rowwise_adagrad")


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    return default if value is None else int(value)


def replicated_tables(
    tables: list, optim: OptimConfig, device: torch.device, weights: dict[str, Tensor] | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Data-parallel tables: a replicated recaccel embedding (autograd mode) and the torch
    optimizer running their sparse rule; also what a checkpoint's ``replicated_optim`` is
    checked against.

    Args:
        tables: the data-parallel tables' TableSpecs.
        optim: ``[optim]``.
        device: where the rows live.
        weights: each table's rows [R, D] to start from (None: the module's own init).

    Raises:
        ConfigError: ``optim.sparse`` has no torch-optimizer form.
    """
    from recaccel.ops.embedding import PackedEmbeddingBag

    if optim.sparse not in _REPLICATED_OPTIMIZERS:
        raise ConfigError(
            f"data_parallel tables support optim.sparse = sgd or rowwise_adagrad, got {optim.sparse!r}"
        )
    module = PackedEmbeddingBag(tables, backend="reference", mode="autograd", device=device)
    if weights is not None:
        with torch.no_grad():
            for t in tables:
                module.table_state(t.name)["weight"].copy_(weights[t.name])
    params = list(module.parameters())
    rule = SparseOptimConfig.from_config(optim)
    if optim.sparse == "sgd":
        return module, torch.optim.SGD(params, lr=rule.lr)
    from torchrec.optim import RowWiseAdagrad  # the FBGEMM rule on dense gradients

    return module, RowWiseAdagrad(params, lr=rule.lr, eps=rule.eps)


class _GuardedLookup(nn.Module):
    """Runs the sharded lookup's forward with communication errors made clear.

    In a step of TorchRec's train pipeline the pooled result is computed by the
    pipeline's own call of the sharded module and :meth:`feed` s the next lookup;
    any other lookup (evaluation between steps) first detaches the pipeline, giving
    the sharded module its own forward back.
    """

    def __init__(self, dmp: nn.Module, parallel: HybridParallel) -> None:
        super().__init__()
        self.dmp = dmp
        object.__setattr__(self, "parallel", parallel)  # not a submodule
        self._fed = None

    def feed(self, pooled) -> None:
        """Makes the next lookup return ``pooled`` (a pooled KeyedTensor or its awaitable)."""
        self._fed = pooled

    def clear_feed(self) -> bool:
        """Drops a fed result; returns whether one was left unused."""
        unused, self._fed = self._fed is not None, None
        return unused

    def forward(self, kjt):
        ids = kjt.values().nbytes + kjt.lengths().nbytes
        with (
            self.parallel.collectives("the embedding lookup"),
            self.parallel.monitor.collective("lookup", ids),
        ):
            if self._fed is not None:
                pooled, self._fed = self._fed, None
            else:
                self.parallel.detach_pipeline()
                pooled = self.dmp(kjt)
            values = pooled.values()  # waits for the all-to-all inside the guard
        if values.requires_grad:
            # Its gradient is ready before the backward all-to-all waits for the other ranks:
            # this rank's own compute ends there (the straggler controller's measure).
            values.register_hook(self.parallel.monitor.local_backward_done)
        return pooled


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
        p = cfg.parallel
        check_rule(cfg, "hybrid_needs_drop_last")  # a config changed after it was loaded
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            if not under_torchrun():
                raise ConfigError(
                    "parallel.mode=hybrid runs one process per rank under torchrun: use "
                    "`recaccel-train --nproc N ...` or `torchrun --nproc-per-node N -m recaccel.cli ...`"
                )
            backend = p.backend if p.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        else:
            backend = dist.get_backend()
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(f"parallel.backend=nccl needs CUDA devices; train.device resolves to {device}")
        if backend == "gloo" and device.type == "cuda":
            raise ConfigError("parallel.backend=gloo runs on CPU here; use nccl (or auto) with CUDA devices")
        if device.type == "cuda":
            device = torch.device("cuda", _env_int("LOCAL_RANK", 0))
            torch.cuda.set_device(device)
        self.device = device
        self.backend = backend
        # A group made elsewhere keeps its own timeout.
        self.timeout_s = float(p.timeout_s) if self._owns_group else None
        if self._owns_group:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=p.timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE", self.world_size)
        check_faults(cfg, self.world_size)
        check_straggler(cfg)
        # parallel.straggler: every rank's share of the global batch, decided alike on all.
        self.splitter = (
            SplitController(p.straggler, self.world_size, p.straggler_every, p.backup_factor)
            if p.straggler != "off"
            else None
        )
        self._rebalance, self._backup = p.straggler == "rebalance", p.straggler == "backup"
        self._last_units = 0  # rows (tasks) of this rank's last step, for the next agreement
        self._dynamic_reader = None  # parallel.data=dynamic: this rank's shard reader
        self._empty = None  # backup: a 0-row batch a dry rank trains while others finish
        self._agreed_stop: str | None = None  # a stop signal some rank got, agreed by all
        # Step and collective timings (monitor.every > 0), and fault.slow_rank's sleep.
        self.monitor = Monitor(cfg.monitor, cfg.fault, self.rank, self.world_size, self._comm_device())
        if backend == "gloo":
            with self.collectives("start-up (waiting for every rank)"):
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=p.timeout_s), wait_all_ranks=True)
        self.embedding = None  # the TorchRecEmbedding after wrap()
        self.dmp = None
        self.plan = None
        self.replicated = None  # data-parallel tables (recaccel embedding, autograd mode)
        self.replicated_optimizer: torch.optim.Optimizer | None = None
        self.embedding_prefix = ""
        self._sync: DenseGradSync | None = None
        self._step_denominator = 1.0
        self.step_rows = 0
        self._pipeline = None  # TorchRec's train pipeline while train.pipeline != off trains
        # Called with each local batch a step trains (train.pipeline = off): benchmarks and
        # tests count the rows each rank trained.
        self.on_batch: Callable[[Any], None] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @contextmanager
    def collectives(self, what: str) -> Iterator[None]:
        """Turns a communication failure inside the block into a :class:`CollectiveError`."""
        try:
            yield
        except RuntimeError as e:
            if not is_comm_error(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            limit = (
                "the process group's timeout"
                if self.timeout_s is None
                else f"parallel.timeout_s={self.timeout_s:g}s"
            )
            absent = self.monitor.absent() if hasattr(self, "monitor") else None
            who = "a peer rank exited or did not answer" if absent is None else absent
            raise CollectiveError(
                f"rank {self.rank} of {self.world_size}: {what} failed: {who} within {limit} ({first})"
            ) from e

    # ------------------------------------------------------------------ model

    def wrap(self, module: nn.Module) -> nn.Module:
        """Moves the SparseArch's embedding into TorchRec (sharded) in place; returns ``module``.

        Raises:
            ConfigError: TorchRec is missing, the module has no (or several) SparseArch, or
                unsupported tables.
        """
        try:
            import torchrec  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                f"parallel.mode=hybrid needs TorchRec and FBGEMM (pip install 'recaccel[torchrec]'): {e}"
            ) from None
        from recaccel.models.arches import SparseArch
        from recaccel.models.torchrec_sparse import (
            TorchRecEmbedding,
            embedding_tables,
            load_table_weights,
            table_weights,
        )
        from recaccel.train.distributed.sharding import shard_tables, table_kinds

        arches = [(name, m) for name, m in module.named_modules() if isinstance(m, SparseArch)]
        if len(arches) != 1:
            raise ConfigError(f"hybrid mode needs exactly one SparseArch in the model, found {len(arches)}")
        arch_name, arch = arches[0]
        self.embedding_prefix = f"{arch_name}.embedding." if arch_name else "embedding."
        tables = embedding_tables(arch.embedding)
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ConfigError(f"hybrid mode needs one embedding dim for all tables, got {sorted(dims)}")
        weights = table_weights(arch.embedding)
        kinds = table_kinds(self.cfg.parallel, [t.name for t in tables])
        sharded = [t for t in tables if kinds[t.name] != "data_parallel"]
        local = [t for t in tables if kinds[t.name] == "data_parallel"]
        with self.collectives("sharding the embedding tables"):
            if sharded:
                self.dmp, self.plan = shard_tables(
                    sharded, kinds, self.cfg.optim, self.device, self.local_world_size
                )
                load_table_weights(self.dmp.state_dict(), {t.name: weights[t.name] for t in sharded})
            if local:
                self.replicated, self.replicated_optimizer = replicated_tables(
                    local, self.cfg.optim, self.device, weights
                )
            arch.embedding = TorchRecEmbedding(
                _GuardedLookup(self.dmp, self) if self.dmp is not None else None,
                [f for t in tables for f in t.features],
                dims.pop(),
                replicated=self.replicated,
                replicated_features=[f for t in local for f in t.features],
                register=False,
            )
            self.embedding = arch.embedding
            self._broadcast(module)
        if self.plan is not None:
            from recaccel.train.distributed.sharding import plan_rows

            check_plan_kinds(
                self.cfg.parallel.straggler, {r["table"]: r["sharding"] for r in plan_rows(self.plan)}
            )
            if self.is_main:
                logger.info("embedding sharding plan:\n%s", self.plan)
        return module

    def _broadcast(self, module: nn.Module) -> None:
        """Makes every rank's dense parameters and buffers rank 0's (one broadcast per dtype)."""
        tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.numel()]
        if self.replicated is not None:
            tensors += list(self.replicated.parameters())
        flat_collective(tensors, lambda flat: dist.broadcast(flat, src=0))

    # ------------------------------------------------------------------- data

    def reader(self, make: Callable[[int, int], Reader], *, train: bool) -> Reader:
        """This rank's reader, from ``make(rank, world_size)`` building a plain one.

        Training with ``parallel.data = "sharded"`` reads this rank's row groups, with
        ``dynamic`` the shards rank 0's shard service hands it; otherwise every rank reads
        the global batches and keeps its slice (evaluation always: all ranks must run the
        same number of lookups).
        """
        if train and self.cfg.parallel.data == "sharded":
            return make(self.rank, self.world_size)
        if train and self.cfg.parallel.data == "dynamic":
            from recaccel.train.distributed.shard_service import DynamicShardReader, ShardService

            store = dist.distributed_c10d._get_default_store()  # hosted by rank 0
            service = ShardService(store, self.rank, self.world_size, self.cfg.parallel.timeout_s)
            # backup: batches follow the controller's sizes, so ranks take shards as they need them.
            self._dynamic_reader = DynamicShardReader(
                make(0, 1), service, self.cfg.data.shard_row_groups, ragged=self._backup
            )
            return self._dynamic_reader
        if train and self._rebalance:
            return make(0, 1)  # global batches: batches() slices them by the agreed split
        return GlobalSlices(make(0, 1), self.rank, self.world_size, train=train, whole_tasks=not train)

    def steps(
        self,
        source: Iterable[BatchWithState],
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        train: TrainConfig,
    ) -> Iterator[StepDone]:
        """This rank's batches, one hybrid step each: :meth:`batches` and :meth:`train_step`
        (``train.pipeline = "off"``), or TorchRec's train pipeline over the sharded model
        (``sync`` / ``semi_sync``, see :mod:`recaccel.train.distributed.hybrid_pipeline`).

        Raises:
            ConfigError: micro-batches (single-process only), or a pipeline this setup
                cannot run.
        """
        if train.micro_batches > 1:
            raise ConfigError(
                f"train.micro_batches={train.micro_batches} runs parallel.mode=single; use train.micro_batches=1"
            )
        if train.cuda_graphs or train.compile:
            key = "train.cuda_graphs" if train.cuda_graphs else "train.compile"
            raise ConfigError(f"{key}=true runs parallel.mode=single; set it to false in hybrid mode")
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
            loss = self.train_step(objective, optimizer, batch)
            yield StepDone(loss, position["state"], self.step_rows)

    def use_pipeline(self, pipeline) -> None:
        """Records TorchRec's train pipeline now driving the sharded module (None: none)."""
        self._pipeline = pipeline

    def detach_pipeline(self) -> None:
        """Gives the sharded module its own forward back (TorchRec's ``detach``; the
        pipeline's next ``progress`` re-attaches it, batches in flight kept)."""
        if self._pipeline is not None and self._pipeline._model_attached:
            self._pipeline.detach()

    def batches(self, loader: Iterable, objective: Objective) -> Iterator:
        """The loader's batches for as long as every rank has one.

        Before each step :meth:`agree` tells every rank whether all have a batch and the
        global normaliser (:attr:`step_rows` gets the global row count). A rank that runs
        dry still joins it, so all stop together.
        """
        items = iter(loader)
        while True:
            batch = next(items, None)
            if self._backup and self._empty is None and batch is not None:
                self._empty = batch.slice_rows(0, 0)
            agreed = self.agree(batch, objective)
            if agreed is None:
                return
            self._step_denominator, self.step_rows = agreed
            if batch is None:
                batch = self._empty  # backup: this rank ran dry, the others still train
            elif self._rebalance:
                sizes = self.splitter.split(units(batch))  # this rank's slice of the global batch
                lo = sum(sizes[: self.rank])
                batch = slice_units(batch, lo, lo + sizes[self.rank])
            yield batch

    def agree(self, batch: Any | None, objective: Objective) -> tuple[float, int] | None:
        """One allreduce of (has a batch, loss normaliser, rows, then every rank's last step
        compute time and units in its own slots, then one slot per stop signal: the ranks
        that got it) over ranks.

        A stop signal any rank got becomes :meth:`stop_requested` on every rank at once,
        so all stop after the same step (and write that step's checkpoint together).

        Under ``parallel.straggler`` the timings feed the :class:`SplitController` (the same
        numbers on every rank: each slot sums one non-zero term). With ``rebalance`` the
        batch is the global one: rank 0 alone contributes its normaliser and rows.

        Args:
            batch: this rank's next batch, or None when it has run dry.
            objective: the objective (its loss kind sets the normaliser).

        Returns:
            The global (loss normaliser, training rows), or None when the epoch ends: some
            rank has no batch (``backup``: every rank).
        """
        w = self.world_size
        stops = 3 + 2 * w  # the first stop slot
        info = torch.zeros(stops + len(STOP_SIGNALS), dtype=torch.float64)
        signal_name = pending_signal()
        if signal_name is not None:
            info[stops + [s.name for s in STOP_SIGNALS].index(signal_name)] = 1.0
        if batch is not None:
            info[0] = 1.0
            if not self._rebalance or self.rank == 0:
                info[1], info[2] = loss_denominator(batch, objective.loss), batch.training_rows
        if self._last_units:
            info[3 + self.rank], info[3 + w + self.rank] = self.monitor.last_compute_s, self._last_units
            self._last_units = 0
        self.monitor.start_step()
        with self.collectives("agreeing on the next step"), self.monitor.collective("agree", info.nbytes):
            buffer = info.to(self._comm_device())
            dist.all_reduce(buffer)
        info = buffer.cpu()
        got = [s.name for s, n in zip(STOP_SIGNALS, info[stops:].tolist()) if n > 0]
        if got and self._agreed_stop is None:
            self._agreed_stop = got[0]  # SIGTERM before SIGINT when ranks got both
        if self.splitter is not None:
            self._steer(info[3 : 3 + w].tolist(), info[3 + w : stops].tolist())
        ready = int(info[0])
        if ready < w and not (self._backup and ready > 0 and (batch is not None or self._empty is not None)):
            self.monitor.drop_step()  # no step follows this agreement
            if batch is not None:
                logger.info("rank %d: another rank ran out of batches; ending the epoch", self.rank)
            return None
        return float(info[1]), int(info[2])

    def stop_requested(self) -> str | None:
        """The stop signal some rank got, as of the last agreement (the same on every rank,
        whichever rank got it and when)."""
        return self._agreed_stop

    def _steer(self, compute_s: list[float], units: list[float]) -> None:
        """Feeds one step's per-rank timings to the controller; ``backup``: a new split sets
        this rank's next batch size (batches already cut keep theirs)."""
        if self.splitter.observe(compute_s, units) and self._dynamic_reader is not None:
            self._dynamic_reader.batch_rows = self.splitter.local_sizes(self.cfg.data.batch_size)[self.rank]

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------- step

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
        if self.on_batch is not None:
            self.on_batch(batch)
        self.zero_grad(optimizer)
        self._last_units = units(batch)
        with self.collectives("the training step"):
            loss = objective.batch_loss(batch)
            share = loss_denominator(batch, objective.loss) / max(self._step_denominator, 1e-12)
            if (
                not self._last_units
            ):  # backup's dry rank: joins the collectives, adds nothing (its mean is 0/0)
                loss = loss.nan_to_num(0.0)
            scaled = loss * share
            scaled.backward()
        return self.sync_and_step(optimizer, scaled.detach())

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

    # ------------------------------------------------------------- evaluation

    def gather(self, tensor: Tensor) -> Tensor:
        """Concatenates a per-rank [N_r, ...] tensor over ranks, in rank order (N_r may differ)."""
        with self.collectives("gathering evaluation results"):
            dev = self._comm_device()
            local = tensor.detach().to(dev).contiguous()
            sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([local.shape[0]], dtype=torch.int64, device=dev))
            longest = int(max(int(s) for s in sizes))
            padded = local.new_zeros((longest, *local.shape[1:]))
            padded[: local.shape[0]] = local
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded)
        return torch.cat([part[: int(n)] for part, n in zip(parts, sizes)]).to(tensor.device)

    # ------------------------------------------------------------ checkpoints

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
                state = self._merged_ledger(state)
            return save_sharded(run_dir, self, model, optimizer, state, keep)

    def _merged_ledger(self, state: TrainState) -> TrainState:
        """``state`` with every rank's dynamic shard ledger merged into its reader position
        (each rank's checkpoint entry then holds the epoch's whole ledger)."""
        from recaccel.train.distributed.shard_service import merge_ledgers

        states: list[Any] = [None] * self.world_size
        dist.all_gather_object(states, state.reader)
        return dataclasses.replace(state, reader=merge_ledgers(states))

    def load_checkpoint(
        self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> TrainState:
        """Restores the newest sharded checkpoint of the run (every rank calls it)."""
        from recaccel.train.distributed.dist_checkpoint import load_sharded

        with self.collectives("reading a checkpoint"):
            return load_sharded(run_dir, self, model, optimizer)

    def close(self) -> None:
        """Leaves the process group if this object created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
