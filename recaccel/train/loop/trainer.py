"""The training loop shared by DLRM and meta-DLRM: the objective differs, the loop does not."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from recaccel.config import Config
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.dataset import open_dataset
from recaccel.io.loader import DeviceLoader
from recaccel.io.readers.protocol import Reader
from recaccel.io.readers.state import epoch_done, saved_counters, set_counters
from recaccel.train.checkpoint.best import next_record
from recaccel.train.checkpoint.paths import all_checkpoints
from recaccel.train.checkpoint.state import TrainState, load_reader_position, save_best
from recaccel.train.distributed.faults import KillRank
from recaccel.train.evaluation.evaluate import MetricWindow
from recaccel.train.loop.data_wait import DataWait
from recaccel.train.loop.finish import incidents, run_figures
from recaccel.train.loop.observers import Note, StepObserver, StepObservers
from recaccel.train.loop.parallel import Parallelism, StepDone
from recaccel.train.loop.preemption import Preempted, StopSignals
from recaccel.train.loop.run_length import run_steps
from recaccel.train.loop.schedule import LRSchedule, sparse_rate_setters
from recaccel.train.loop.setup import (
    build_objectives,
    build_parallel,
    resolve_device,
    resolve_loss,
    seed_generators,
    with_reader_workers,
)
from recaccel.train.model.objectives import DLRMObjective, Objective
from recaccel.train.model.optim import build_dense_optimizer
from recaccel.train.model.precision import log_fallback, matmul_precision
from recaccel.train.model.user_model import ModelSource
from recaccel.train.run.cache_meter import CacheMeter
from recaccel.train.run.console import PhaseTimer, show_eval, show_event
from recaccel.train.run.profiling import StepProfiler
from recaccel.train.run.runlog import RunLog, check_run_dir, clear_run

# The builders live in loop.setup; their old home still names them.
__all__ = ["Trainer", "build_parallel", "resolve_device", "resolve_loss"]

logger = logging.getLogger(__name__)


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
        model: one's own model instead of ``[model]``'s (:mod:`recaccel.train.model.user_model`).
        observers: step observers to add to the run's own (:mod:`recaccel.train.loop.observers`).

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
        model: ModelSource | None = None,
        observers: list[StepObserver] | None = None,
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
        seed_generators(cfg.train)
        log_fallback(cfg.train.precision, self.device)
        train_data = open_dataset(cfg.data.train, cfg.data.schema)
        self.schema = train_data.schema
        cfg = self.cfg = with_reader_workers(cfg, self.device, train_data.num_rows)
        self.objective, self.evaluator = build_objectives(cfg, self.schema, self.device, model)
        self.module = self.parallel.wrap(self.objective.module)
        self.optimizer = build_dense_optimizer(self.objective.module, cfg.optim)
        self.reader = self._reader(self.objective, cfg.data.train, train=True)
        self.state = TrainState()
        if resume:
            self._restore(fresh_if_no_checkpoint)
        # Opened by fit(): evaluating a run's checkpoint must not rewrite its record.
        self.log: RunLog | None = None
        self._clock = 0.0  # perf_counter() when the current stretch of training began
        self.schedule: LRSchedule | None = None  # made by fit(): it needs the run's length
        self._logged = (0, 0.0)  # (samples, training seconds) at the previous train event
        self._saved_at = -1  # the step of the last checkpoint this fit wrote
        self.observers = self._observers(observers or [])
        self._window = self._metric_window()
        self._phases = PhaseTimer()  # -v: time per step between log steps

    def _observers(self, extra: list[StepObserver]) -> StepObservers:
        """The run's step observers: the caches' meter, the profiler, the layout's own
        (hybrid: straggler policy, monitor), fault injection, then ``extra``."""
        steps = self.cfg.train.profile_steps if self.parallel.is_main else []
        own = [CacheMeter(self.objective.module), StepProfiler(self.run_dir, steps, self.device)]
        layout = self.parallel.observers()
        return StepObservers(
            [*own, *layout, KillRank(self.cfg.fault, self.parallel.rank), *extra], self._note
        )

    def _note(self, note: Note) -> None:
        """An observer's note: its event in the log, its line on rank 0's console."""
        self._event(note.kind, **note.fields)
        if note.text is not None and self.parallel.is_main:
            show_event(note.text, *note.args, warning=note.warning)

    def _restore(self, fresh_if_no_checkpoint: bool) -> None:
        """Loads the newest checkpoint of the run directory (model, optimizer, TrainState)."""
        if fresh_if_no_checkpoint and not all_checkpoints(self.run_dir):
            logger.warning("%s has no checkpoint yet: training starts from step 0", self.run_dir)
            return
        self.state = self.parallel.load_checkpoint(self.run_dir, self.objective.module, self.optimizer)
        logger.info("resumed %s at step %d", self.run_dir, self.state.step)

    def _reader(self, objective: Objective, path: str, *, train: bool) -> Reader:
        def make(rank: int, world_size: int) -> Reader:
            return objective.reader(path, train=train, rank=rank, world_size=world_size)

        return self.parallel.reader(make, train=train)

    def _loader(self, reader: Reader) -> DeviceLoader:
        return DeviceLoader(reader, self.device, self.cfg.data.prefetch, backend=self.cfg.data.loader_backend)

    def _event(self, kind: str, **fields: Any) -> None:
        if self.log is not None:
            self.log.event(kind, **fields)

    def _reached_end(self) -> bool:
        t = self.cfg.train
        if self._stopped_early():
            return True
        return self.state.step >= t.steps if t.steps > 0 else self.state.epoch >= t.epochs

    def _total_steps(self) -> int | None:
        """The run's steps, the same on every rank (None: not known ahead): ``train.steps``,
        else the epochs' exact batch counts summed (see :mod:`~recaccel.train.loop.run_length`)."""
        t = self.cfg.train
        if t.steps > 0:
            return t.steps
        return run_steps(self.reader, t.epochs, lambda row: self.parallel.gather(row.to(self.device)))

    def _schedule(self, total: int | None) -> LRSchedule:
        """The learning-rate schedule over this run's ``total`` steps."""
        setters = sparse_rate_setters(self.objective.module, self.parallel)
        return LRSchedule(self.cfg.optim, total, self.optimizer, setters)

    def _checkpoint(self) -> None:
        keep = self.cfg.train.keep_checkpoints
        self.parallel.save_checkpoint(self.run_dir, self.objective.module, self.optimizer, self.state, keep)
        self._saved_at = self.state.step
        self.observers.on_checkpoint(self.state.step)

    def _stopped_early(self) -> bool:
        return self.state.best is not None and self.state.best.stopped_at is not None

    # ------------------------------------------------------------------ fit

    def fit(self) -> dict[str, Any]:
        """Trains until ``train.steps`` (or ``train.epochs``), evaluates, writes metrics.json
        (and the resolved config.toml and log.jsonl in the run directory).

        SIGTERM or SIGINT (fit in the main thread) stops the run gracefully: the step in
        progress finishes (a periodic evaluation too; a signal during the data start-up
        stops after the first step), its checkpoint is written, log.jsonl gets a
        ``stopped`` event and is closed, and :class:`~recaccel.train.loop.preemption.Preempted`
        is raised. Resuming the run then equals the run never stopped. A signal during the
        final evaluation lets it finish: the run completes (its last checkpoint is already
        written). A second signal ends the process at once. Hybrid ranks all stop after
        the same step. The previous signal handlers are back when fit returns or raises.

        The run's ``train.precision`` sets torch's TF32 switches for the whole of fit
        (steps, backward, evaluations); they are back as they were when fit returns or raises
        (:func:`~recaccel.train.model.precision.matmul_precision`).

        Raises:
            Preempted: stopped by SIGTERM or SIGINT, the checkpoint of its last step saved
                (a ``KeyboardInterrupt``: ``except Exception`` lets it through).
            RecaccelError: bad data or checkpoints met while training.
        """
        with StopSignals(), matmul_precision(self.cfg.train.precision):
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        from recaccel.train.run.sanity import sanity_pass

        sanity_pass(self)  # bad evaluation data, a host cache too small: refused (or sized) before step 1
        total = self._total_steps()
        self.schedule = self._schedule(total)
        self._open_run()
        bar = tqdm(
            total=total,
            initial=self.state.step,
            unit="step",
            disable=not (self.cfg.train.progress and self.parallel.is_main),
        )
        loader = self._loader(self.reader)
        wait = DataWait()
        seconds_before = self.state.train_seconds
        if self.state.data is not None:  # resumed: counting goes on
            set_counters(self.reader.counters, self.state.data)
        self._logged = (self.state.samples, self.state.train_seconds)
        self.module.train()
        self.observers.on_start(self.state.step)
        while not self._reached_end():
            self._run_epoch(loader, wait, bar)
        self.observers.close()
        bar.close()
        self._checkpoint()
        self._stop_if_requested(bar)  # stopped during the last step: evaluation waits for --resume
        return self._finish(wait, seconds_before)

    def _open_run(self) -> None:
        """Rank 0 opens the run's record: log.jsonl, and the resolved config.toml."""
        if not self.parallel.is_main:
            return
        if self.overwrite:  # before any rank writes: they meet at a collective first
            clear_run(self.run_dir)
        self.log = RunLog(self.run_dir, loggers=self.cfg.train.loggers, resumed_at=self.state.step)
        self.log.write_config(self.cfg)
        self._note_restart()

    def _note_restart(self) -> None:
        """A rank restarted by the launcher's agent after a failure (``--max-restarts``):
        a ``restart`` event and one console line."""
        from recaccel.train.distributed.launch import restart_count, under_torchrun

        count = restart_count() if under_torchrun() else 0
        if count == 0:
            return
        self._event("restart", step=self.state.step, restart=count)
        show_event(
            "restart %d: a rank failed; every rank restarted, resuming at step %d",
            count,
            self.state.step,
            warning=True,
        )

    def _run_epoch(self, loader: DeviceLoader, wait: DataWait, bar: tqdm) -> None:
        """Trains on the rest of ``state.epoch`` (or up to ``train.steps``).

        Raises:
            DataError: a fresh epoch that formed no batch at all.
        """
        finished = self._enter_epoch()
        steps_before = self.state.step
        self._clock = time.perf_counter()
        source = wait.wrap(() if finished else loader.iter_with_state())
        self.schedule.apply(self.state.step)  # the rates of the next step, before its forward
        # Hybrid: every rank agrees before each step that all ranks have a batch.
        steps = self.parallel.steps(source, self.objective, self.optimizer, self.cfg.train, self.observers)
        for done in steps:
            self._record_step(done)
            self.observers.after_step(self.state.step, done)
            bar.update(1)
            self._log(done.loss, bar, wait)
            if not self._reached_end():
                self.schedule.apply(self.state.step)
            self._maybe_evaluate()  # first: the checkpoint of this step holds its best record
            self._maybe_checkpoint()
            if self._reached_end():
                break
            self._stop_if_requested(bar)
        self._stop_clock()
        if self.state.step == steps_before and self.state.reader is None:
            raise DataError(f"no training batch could be formed from {self.cfg.data.train}")
        stopped_at_steps = self.cfg.train.steps > 0 and self.state.step >= self.cfg.train.steps
        if not (stopped_at_steps or self._stopped_early()):
            self.state.epoch += 1
            self.state.reader = None

    def _enter_epoch(self) -> bool:
        """Moves the reader to ``state.epoch`` (at the saved position when resuming);
        returns whether that position is already the epoch's end.

        A state saved after the epoch's last batch would have the reader go on into the
        next epoch, which the loop counts as the next one. Every rank still joins the
        (empty) pass, so hybrid ranks agree the epoch is over.
        """
        self.reader.set_epoch(self.state.epoch)
        if self.state.reader is None:
            return False
        load_reader_position(self.reader, self.state.reader, self.run_dir)
        return epoch_done(self.state.reader)

    def _record_step(self, done: StepDone) -> None:
        """The state after a step: its count, rows, and the reader position and counters
        paired with its batch (the pipeline and the loader may have read further)."""
        self.state.step += 1
        self.state.samples += done.rows
        self.state.reader = done.reader_state
        self.state.data = self._counters(self.state.reader)

    def _log(self, loss: torch.Tensor, bar: tqdm, wait: DataWait) -> None:
        """Every ``train.log_every`` steps (and the first): the loss to the bar and the log,
        with the step's rates and the throughput and data wait since the previous event."""
        step = self.state.step
        if step % self.cfg.train.log_every and step != 1:
            return
        from recaccel.ops.embedding import check_deferred_ids

        check_deferred_ids(self.module)  # the lookup kernels' bad-id counts, read once per log step
        self.state.last_loss = float(loss)
        bar.set_postfix(loss=f"{self.state.last_loss:.4f}")
        observed = self.observers.log_fields(step)  # the caches' traffic since the last event
        seconds = self.state.train_seconds + time.perf_counter() - self._clock
        samples, since = self._logged
        self._logged = (self.state.samples, seconds)
        if self.parallel.is_main:
            self._phases.show(step, seconds, wait.seconds, self.state.data or self.reader.counters)
        elapsed = max(seconds - since, 1e-9)
        self._event(
            "train",
            step=step,
            epoch=self.state.epoch,
            loss=self.state.last_loss,
            lr=float(self.optimizer.param_groups[0]["lr"]),  # this step's (a tensor in a captured step)
            sparse_lr=self.schedule.rates(step - 1)[1],
            samples_per_s=(self.state.samples - samples) / elapsed,
            data_wait_s=wait.seconds,
            **observed,
            **self._train_extras(),
        )

    def _metric_window(self) -> MetricWindow | None:
        """train.metric_window's window over the training logits (this rank's rows), hooked
        into the objective; None when off.

        Raises:
            ConfigError: a window in meta mode.
        """
        rows = self.cfg.train.metric_window
        if rows == 0:
            return None
        if not isinstance(self.objective, DLRMObjective):
            raise ConfigError(
                f"config key train.metric_window={rows} runs train.mode=dlrm (a meta step scores tasks); use 0"
            )
        window = MetricWindow(rows, self.objective.loss)
        self.objective.watch = window.add
        return window

    def _train_extras(self) -> dict[str, Any]:
        """The window's metrics and the dense gradients' norm before clipping (with
        optim.grad_clip_norm), for a train event."""
        extras = self._window.metrics() if self._window is not None else {}
        norm = getattr(self.optimizer, "grad_norm", None)
        if norm is not None:
            extras["grad_norm"] = float(norm)
        return extras

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.train.checkpoint_every
        if every > 0 and self.state.step % every == 0:
            self._checkpoint()

    def _maybe_evaluate(self) -> None:
        """Every ``train.eval_every`` steps: an ``eval`` event (its time is not training time)."""
        every = self.cfg.train.eval_every
        if every <= 0 or self.state.step % every:
            return
        self._stop_clock()
        metrics = self.evaluate()
        self._event("eval", step=self.state.step, **metrics)
        if self.cfg.train.best_metric:
            self._judge(metrics)  # first: a metric it refuses is the only line
        if self.parallel.is_main:
            show_eval(self.state.step, metrics)
        self.module.train()
        self._clock = time.perf_counter()

    def _judge(self, metrics: dict[str, Any]) -> None:
        """Records this evaluation against train.best_metric's best: a better one is saved as
        best.pt; the patience-th evaluation in a row without one stops the run early."""
        self.state.best = next_record(self.state.best, metrics, self.cfg.train, self.state.step)
        best = self.state.best
        if best.step == self.state.step and best.evals_since == 0:
            save_best(self.run_dir, self.objective.module, self.optimizer, self.state)
            self._event("best", step=self.state.step, metric=self.cfg.train.best_metric, value=best.value)
        elif best.stopped_at is not None:
            logger.info(
                "early stop at step %d: %s has not improved on step %d's %.6g in %d evaluations",
                self.state.step,
                self.cfg.train.best_metric,
                best.step,
                best.value,
                best.evals_since,
            )
            self._event("early_stop", step=self.state.step, best_step=best.step, best_value=best.value)

    def _stop_if_requested(self, bar: tqdm) -> None:
        """After a step: on a stop signal (agreed by every rank), checkpoints this step,
        closes the run and raises :class:`Preempted`."""
        signal_name = self.parallel.stop_requested()
        if signal_name is None:
            return
        if self._saved_at != self.state.step:
            self._stop_clock()  # the checkpoint carries the training time so far
            self._checkpoint()
        bar.close()
        self.observers.close()
        logger.info("%s: stopped at step %d, checkpoint saved", signal_name, self.state.step)
        self._event("stopped", signal=signal_name, step=self.state.step, epoch=self.state.epoch)
        if self.log is not None:
            self.log.close()
        self.parallel.close()
        raise Preempted(signal_name, self.state.step, self.run_dir)

    def _stop_clock(self) -> None:
        """Adds the training time since the clock last started to ``state.train_seconds``."""
        self.state.train_seconds += time.perf_counter() - self._clock

    def _finish(self, wait: DataWait, seconds_before: float) -> dict[str, Any]:
        """Evaluates, writes the final event and metrics.json, closes the run."""
        metrics = self.evaluate_all()
        if self.parallel.is_main:
            show_eval(self.state.step, metrics, final=True)
        metrics.update(
            run_figures(self.state, wait, seconds_before, self.reader.counters, self.cfg.train),
            **self.observers.final_metrics(),  # cache totals; hybrid rank 0: monitor, straggler
        )
        metrics.update(self._incidents())
        metrics.update(self.parallel.step_figures())  # a whole-step graph: graphed / eager steps
        self._event("final", **metrics)
        if self.log is not None:
            self.log.write_metrics(metrics)
            self.log.close()
        self.parallel.close()  # hybrid: leaves the process group only if it started it
        return metrics

    def _incidents(self) -> dict[str, int]:
        """Rank 0: the run's restarts and monitor flags, from its log (none elsewhere)."""
        return incidents(self.run_dir) if self.log is not None else {}

    def _counters(self, position: dict[str, Any]) -> dict[str, int]:
        """The reader counters as of the last trained batch: those paired with its position
        (the loader reads ahead), else the reader's own."""
        paired = saved_counters(position)
        return paired if paired is not None else dict(self.reader.counters)

    # ----------------------------------------------------------- evaluation

    def evaluate(self, path: str | None = None) -> dict[str, Any]:
        """Metrics of the current model on ``path`` (default ``data.test``)."""
        path = path or self.cfg.data.test
        reader = self._reader(self.evaluator, path, train=False)
        self.module.eval()
        with self._eval_bar(reader) as bar:
            return self.evaluator.evaluate(bar, gather=self.parallel.gather, source=path)

    def _eval_bar(self, reader: Reader) -> tqdm:
        """The evaluation's batches behind a progress bar (total: the reader's batches when
        known), gone when it ends."""
        return tqdm(
            self._loader(reader),
            total=reader.num_batches,
            desc="eval",
            unit="batch",
            leave=False,
            disable=not (self.cfg.train.progress and self.parallel.is_main),
        )

    def evaluate_all(self) -> dict[str, Any]:
        """Metrics on data.test at the top level; with ``meta.eval_states`` (``name=path``)
        also one entry per state under ``states``, data.test's named after its folder."""
        metrics = self.evaluate()
        if self.cfg.meta.eval_states:
            states = {Path(self.cfg.data.test).name: dict(metrics)}
            for spec in self.cfg.meta.eval_states:  # "name=path", as MetaConfig checked
                name, _, path = spec.partition("=")
                states[name] = self.evaluate(path)
            metrics["states"] = states
        return metrics
