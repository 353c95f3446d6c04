"""The whole training step as one CUDA graph (``train.cuda_graphs = true`` with
``train.cuda_graph_scope = "step"``).

A DLRM step launches a few dozen kernels and library calls: the preparation (routing,
the deferred bounds check, the sort of the backward and its pieces), the packed lookup,
the dense head, the loss, the backward with its fused sparse update, and the dense
optimizer step. Captured once and replayed, it costs the host one graph launch and a few
copies, so the host stays ahead of the device however short the step.
:class:`GraphedStep` runs the steps of a run as:

1. warm-up: steps run eagerly on a side stream (torch's CUDA graph notes: lazy
   initialisation, cuBLAS workspaces, Triton compilation, the routing's index tensors and
   the lane grid's occupancy happen before the capture) until :data:`WARMUP_STEPS`
   batches of one signature have run. They are ordinary steps of the run.
2. capture: the next batch of that signature is copied into static tensors (:class:`StaticBatch`) and one
   step reading them is captured (preparation, forward, backward, dense optimizer step),
   then replayed for that batch.
3. replay: every later batch of the same signature (shapes, dtypes, keys, id counts per
   field) is copied into the static tensors and the graph replayed; the loss is copied out.

Any other batch (the last, smaller batch of an epoch without ``data.drop_last``, multi-hot
bags of another total length) runs eagerly, counted in :attr:`GraphedStep.eager_steps` and
logged once. A capture that fails (an operation a graph cannot hold) is logged with its
reason and the run goes on eagerly: nothing of a capture runs, so no step is lost or
doubled.

The step's host work that a replay does not redo is done here after each replay:

- the deferred bounds check: the graph's bad-id counter is copied and queued under the
  batch itself (:meth:`~recaccel.ops.embedding.PackedEmbeddingBag.queue_replayed_check`),
  so an out-of-range id raises with its own feature, id and row, as eagerly;
- ``objective.watch`` (``train.metric_window``): called with copies of the step's logits
  and labels;
- ``optimizer.grad_norm`` (``optim.grad_clip_norm``): the graph's norm tensor;
- the step counts the host keeps (torch's Adagrad's, whose rate does not depend on them:
  recaccel sets no ``lr_decay``; the packed embedding's update counts): advanced by one,
  so the state and checkpoints are those of eager steps (the capture's own advance is undone).

The learning rates live in device tensors that the schedule refills between steps: the
packed embedding's (:meth:`~recaccel.ops.embedding.PackedEmbeddingBag.keep_rates_in_place`,
read by the Triton update kernels) and the dense Adam's (made capturable, its rate a tensor:
torch keeps its step counts on the device too). What a replay repeats as captured: sparse
Adam's bias corrections, the rounding seed of 16-bit rows, and the rate of a dense SGD or
Adagrad (torch reads theirs on the host). The config refuses what would need those to
change (:func:`recaccel.config.rules.check_rules`, ``step_graph_replays_fixed_rates``). The parameters'
gradients are set to None before the capture, so the captured backward allocates them in
the graph's memory and each replay overwrites them, as in torch's whole-network capture.

Shapes: B batch, Dd dense features, F sparse fields, N ids.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.ops.embedding import PackedEmbeddingBag
from recaccel.sparse import Batch
from recaccel.train.loop.pipeline import StepInput, batch_tensors
from recaccel.train.model.objectives import DLRMObjective, Objective

logger = logging.getLogger(__name__)

# Eager steps before the capture (torch's CUDA graph notes ask for a few, on a side stream).
WARMUP_STEPS = 3
# Batch signatures the warm-up tracks before it gives up (no batch kind repeats).
MAX_SIGNATURES = 16

# Captures a step body; returns its replay. The CUDA one is :func:`capture_cuda_graph`; a
# test may pass one that replays by running the body again.
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def capture_cuda_graph(body: Callable[[], None]) -> Callable[[], None]:
    """Captures ``body``'s CUDA work in one graph (nothing of it runs); returns the replay.

    ``thread_local`` capture mode: the loader's threads may pin memory and copy meanwhile.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        body()
    return graph.replay


def _described(t: Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.device)


def _cloned(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


class StaticBatch:
    """The device tensors a captured step reads, refilled from each batch of the signature.

    Args:
        batch: the batch whose copy the capture reads (a raw :class:`Batch`: dense [B, Dd],
            sparse ids [N] with explicit or implicit offsets, labels [B], weights).
    """

    def __init__(self, batch: Batch) -> None:
        self.signature = self.signature_of(batch)
        sf = batch.sparse
        sparse = sf.with_tensors(_cloned(sf.values), _cloned(sf.explicit_offsets), _cloned(sf.weights))
        self.batch = Batch(_cloned(batch.dense), sparse, _cloned(batch.labels), _cloned(batch.weights))

    @staticmethod
    def signature_of(batch: Batch) -> tuple:
        """What a batch must share with the captured one to be replayed: every tensor's
        shape, dtype and device, the sparse keys and each field's id count (when known)."""
        sf = batch.sparse
        return (
            _described(batch.dense),
            _described(batch.labels),
            _described(batch.weights),
            tuple(sf.keys),
            _described(sf.values),
            _described(sf.explicit_offsets),
            _described(sf.weights),
            sf.known_field_counts,
        )

    def matches(self, batch: Batch) -> bool:
        return isinstance(batch, Batch) and self.signature_of(batch) == self.signature

    def fill(self, batch: Batch) -> None:
        """Copies ``batch`` (of :attr:`signature`) into the static tensors, on the current stream."""
        pairs = (
            (self.batch.dense, batch.dense),
            (self.batch.labels, batch.labels),
            (self.batch.weights, batch.weights),
            (self.batch.sparse.values, batch.sparse.values),
            (self.batch.sparse.explicit_offsets, batch.sparse.explicit_offsets),
            (self.batch.sparse.weights, batch.sparse.weights),
        )
        with torch.no_grad():
            for static, new in pairs:
                if static is not None:
                    static.copy_(new)


def hold_rates_in_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Makes a torch optimizer that can be captured (Adam) capturable, its groups' rates
    float32 tensors on their parameters' device that the schedule refills
    (:func:`~recaccel.train.loop.schedule.set_group_rates`), and its ``state_dict`` save
    them as numbers, so a checkpoint loads into any run (:func:`floats_in_state_dict`)."""
    optimizer.defaults["capturable"] = True  # kept across load_state_dict (keep_run_settings)
    for group in optimizer.param_groups:
        group["capturable"] = True
        if not isinstance(group["lr"], Tensor):
            device = group["params"][0].device
            group["lr"] = torch.full((), float(group["lr"]), dtype=torch.float32, device=device)
    floats_in_state_dict(optimizer)


def floats_in_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """Makes ``optimizer.state_dict()`` write each group's rate as a number (the live one
    may be a tensor) and ``capturable`` as False: what a run without a captured step
    reads, and what one with it makes capturable again (:func:`hold_rates_in_tensors`)."""

    def as_numbers(opt: torch.optim.Optimizer, state: dict) -> dict:
        for group in state["param_groups"]:  # copies of the live groups (torch packs them anew)
            if isinstance(group.get("lr"), Tensor):
                group["lr"] = float(group["lr"])
            if "capturable" in group:
                group["capturable"] = False
        return state

    optimizer.register_state_dict_post_hook(as_numbers)


def host_step_counts(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The optimizer's step counts kept on the host (torch's foreach Adagrad: CPU tensors,
    advanced by host work that a replay does not redo); fused and capturable optimizers
    keep theirs on the device, where a replay advances them."""
    counts = (state.get("step") for state in optimizer.state.values())
    return [c for c in counts if isinstance(c, Tensor) and c.device.type == "cpu"]


def step_graph_unsupported(objective: Objective, device: torch.device) -> str | None:
    """Why a whole-step graph cannot run ``objective`` on ``device``, or None when it can."""
    if not isinstance(objective, DLRMObjective):
        return "train.mode=dlrm"
    embedding = objective.embedding
    if not isinstance(embedding, PackedEmbeddingBag):
        return f"recaccel's packed embedding, not a {type(embedding).__name__}"
    if embedding.mode != "fused":
        return f"the packed embedding's fused update, not mode {embedding.mode!r}"
    if device.type == "cuda" and embedding.backend != "triton":
        return f"the packed embedding's Triton backend on CUDA, not {embedding.backend!r}"
    if embedding.cached_packs():
        return "tables on the device (host tables fill their cache on the host)"
    return embedding.replay_unsupported()


class GraphedStep:
    """The step of ``train.cuda_graph_scope = "step"`` (see the module's docstring).

    Batches come unprepared (:attr:`prepares_in_step`): the preparation is part of the
    captured step. The loop keeps the runner across its calls (:attr:`persistent`), so a
    run captures once.

    Args:
        objective: a DLRM objective over recaccel's packed, fused embedding.
        device: where the step runs (CUDA, unless ``capture`` is given).
        warmup_steps: eager steps before the capture.
        capture: captures a step body and returns its replay (default
            :func:`capture_cuda_graph`).

    Raises:
        ConfigError: the objective or device cannot be captured (one line naming why).
    """

    prepares_in_step = True
    persistent = True  # the loop keeps it from epoch to epoch: one capture per run

    def __init__(
        self,
        objective: Objective,
        device: torch.device,
        *,
        warmup_steps: int = WARMUP_STEPS,
        capture: Capture | None = None,
    ) -> None:
        reason = step_graph_unsupported(objective, device)
        if reason is None and capture is None and device.type != "cuda":
            reason = f"a CUDA device, not {device}"
        if reason is not None:
            raise ConfigError(f"train.cuda_graph_scope=step needs {reason}; use train.cuda_graph_scope=head")
        if warmup_steps < 1:
            # The routing's index tensors and every kernel's compilation must exist before a capture.
            raise ValueError(f"GraphedStep: warmup_steps must be >= 1, got {warmup_steps}")
        self.objective: DLRMObjective = objective
        self.embedding: PackedEmbeddingBag = objective.embedding
        self.device = device
        self.warmup_steps = warmup_steps
        self.capture = capture if capture is not None else capture_cuda_graph
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.static: StaticBatch | None = None
        self._replay: Callable[[], None] | None = None
        self._prepared: Batch | None = None  # the static batch, prepared inside the graph
        self._loss: Tensor | None = None
        self._watched: tuple[Tensor, Tensor] | None = None
        self._grad_norm: Tensor | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self.failed: str | None = None  # why the capture failed, if it did
        self._warm: dict[tuple, int] = {}  # eager steps per batch signature before the capture
        self.graphed_steps = 0
        self.eager_steps = 0
        self._fallback_logged = False

    @property
    def captured(self) -> bool:
        return self._replay is not None

    @property
    def steps(self) -> int:
        return self.graphed_steps + self.eager_steps

    def figures(self) -> dict[str, int | str]:
        """This process's steps by the graph and eagerly, and how the capture went (metrics.json)."""
        capture = "ok" if self.captured else ("failed: " + self.failed if self.failed else "not yet")
        return {
            "graphed_steps": self.graphed_steps,
            "eager_steps": self.eager_steps,
            "graph_capture": capture,
        }

    def train_step(self, item: StepInput, optimizer: torch.optim.Optimizer) -> Tensor:
        """One whole step on ``item.batch``, the dense optimizer's step included; returns the
        detached step loss."""
        self._bind(optimizer)
        batch = item.batch
        graphable = self._graphable(batch)
        warming_up = graphable and not self.captured and self.failed is None
        if warming_up:
            signature = StaticBatch.signature_of(batch)
            # Only a batch whose kind the warm-up ran (its kernels compiled, its routing
            # made): a first short batch would be captured and every later one run eagerly.
            if self._warm.get(signature, 0) >= self.warmup_steps:
                self._capture(batch, optimizer)
            elif len(self._warm) >= MAX_SIGNATURES:
                self._give_up()
                warming_up = False
            else:
                self._warm[signature] = self._warm.get(signature, 0) + 1
        if graphable and self.captured and self.static.matches(batch):
            return self._replayed(batch, optimizer)
        self._note_fallback(batch, graphable)
        return self._eager(batch, optimizer, on_side_stream=warming_up)

    def _bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Makes the dense optimizer capturable, once (its step counts live on the device)."""
        if self._optimizer is optimizer:
            return
        if self._optimizer is not None:
            raise RuntimeError("GraphedStep: a captured step replays one optimizer; build a new GraphedStep")
        self._optimizer = optimizer
        self.embedding.keep_rates_in_place()  # the schedule refills the rate tensors the graph reads
        if "capturable" in optimizer.defaults and self.device.type == "cuda":
            hold_rates_in_tensors(optimizer)

    def _graphable(self, batch: object) -> bool:
        return (
            isinstance(batch, Batch)
            and batch.batch_size > 0
            and torch.is_grad_enabled()
            and self.objective.module.training
        )

    # ------------------------------------------------------------------ eager

    def _eager(self, batch: Batch, optimizer: torch.optim.Optimizer, *, on_side_stream: bool) -> Tensor:
        """One eager step; warm-up steps run on the side stream (CUDA)."""
        self.eager_steps += 1
        if not on_side_stream or self._side is None:
            return self._eager_step(batch, optimizer)
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)  # the batch's hand-over and the previous step
        with torch.cuda.stream(self._side):
            loss = self._eager_step(batch, optimizer)
        main.wait_stream(self._side)
        for tensor in batch_tensors(batch):
            if tensor.is_cuda:
                tensor.record_stream(self._side)
        return loss

    def _eager_step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> Tensor:
        prepared = self.objective.prepare(batch)
        optimizer.zero_grad(set_to_none=True)
        loss = self.objective.batch_loss(prepared)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def _give_up(self) -> None:
        """No batch signature repeated over :data:`MAX_SIGNATURES` kinds (multi-hot bags whose
        total length varies): nothing to capture; the run goes on with eager steps."""
        self.failed = f"no batch signature repeated {self.warmup_steps} times among {len(self._warm)} kinds"
        self._warm.clear()
        logger.warning(
            "cuda graphs: %s (multi-hot bags of varying total length?): the whole training step is not "
            "captured; the run goes on with eager steps",
            self.failed,
        )

    def _note_fallback(self, batch: object, graphable: bool) -> None:
        if not self.captured or self._fallback_logged or not graphable:
            return
        self._fallback_logged = True
        logger.info(
            "cuda graphs: a batch of %d rows does not match the captured step's (%d rows); steps on "
            "such batches run eagerly (logged once)",
            batch.batch_size,
            self.static.batch.batch_size,
        )

    # ------------------------------------------------------------ capture

    def _capture(self, batch: Batch, optimizer: torch.optim.Optimizer) -> None:
        """Captures one step reading a static copy of ``batch``; on failure logs why and
        leaves the run eager."""
        static = StaticBatch(batch)

        def body() -> None:
            # No gradient before the backward (host work only): the captured backward makes
            # them in the graph's memory, and every replay writes them afresh.
            optimizer.zero_grad(set_to_none=True)
            with self.embedding.checks_by_caller(), self._watch_recorded():
                prepared = self.objective.prepare(static.batch)
                loss = self.objective.batch_loss(prepared)
                loss.backward()
                optimizer.step()
            self._prepared, self._loss = prepared, loss.detach()
            self._grad_norm = getattr(optimizer, "grad_norm", None)  # the clipping hook's, if any

        counts = self._host_counts(optimizer)
        before = [c.clone() for c in counts]
        try:
            replay = self.capture(body)
        except (RuntimeError, ValueError) as e:
            self.failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self._prepared = self._loss = self._watched = self._grad_norm = None
            optimizer.zero_grad(set_to_none=True)  # nothing captured ran: no gradient is real
            logger.warning(
                "cuda graphs: capturing the whole training step failed (%s); the run goes on with eager steps",
                self.failed,
            )
            return
        finally:
            for count, was in zip(counts, before):  # a capture runs the host's part of a step once
                count.copy_(was)
        self.static, self._replay = static, replay
        logger.info("cuda graphs: captured the whole training step for batches of %d rows", batch.batch_size)

    @contextlib.contextmanager
    def _watch_recorded(self) -> Iterator[None]:
        """Within the block, ``objective.watch`` records the step's logits and labels (the
        graph's tensors) instead of taking them: :meth:`_replayed` hands copies over."""
        watch = self.objective.watch
        if watch is None:
            yield
            return

        def record(logits: Tensor, labels: Tensor) -> None:
            self._watched = (logits.detach(), labels.detach())

        self.objective.watch = record
        try:
            yield
        finally:
            self.objective.watch = watch

    def _host_counts(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """The step counts the host advances in a step: the dense optimizer's kept on the
        host (torch's Adagrad) and the packs' update counts."""
        return host_step_counts(optimizer) + self.embedding.step_counts()

    # ------------------------------------------------------------- replay

    def _replayed(self, batch: Batch, optimizer: torch.optim.Optimizer) -> Tensor:
        """``batch``'s step by the graph, then the host work a replay does not redo."""
        self.embedding.raise_landed_checks()  # as an eager lookup would, before this step trains
        self.static.fill(batch)
        counts = self._host_counts(optimizer)
        before = [float(c) for c in counts]
        self._replay()
        for count, was in zip(counts, before):
            if float(count) == was:  # a graph replay (a capture stand-in that reruns the body moves them)
                count.add_(1)
        self.graphed_steps += 1
        self.embedding.queue_replayed_check(batch.sparse, self._prepared.sparse)
        if self._watched is not None and self.objective.watch is not None:
            logits, labels = self._watched
            self.objective.watch(logits.clone(), labels.clone())
        if self._grad_norm is not None:
            optimizer.grad_norm = self._grad_norm
        return self._loss.clone()
