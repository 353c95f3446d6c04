"""The candidates of ``recaccel-bench train``: one training step each, and the same step
split into phases for the instrumented pass.

- ``recaccel``: the trainer's own step (:func:`recaccel.models.factory.build_model`, the
  DLRM objective's loss, :class:`~recaccel.train.parallel.SingleProcess`'s step, the dense
  optimizer of :func:`~recaccel.train.optim.build_dense_optimizer`) on auto backends,
  the sparse optimizer fused into the embedding's backward;
- ``reference``: the same with the reference backends;
- ``eager``: :class:`~recaccel.bench.train_eager.EagerDLRM` with a torch optimizer for
  the tables and the dense one for the MLPs;
- ``compiled``: ``eager`` with its dense part (MLPs, interaction, loss) under
  ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from recaccel.bench.train_eager import EagerDLRM, sparse_optimizer
from recaccel.config import Config, InteractionBackend
from recaccel.io.format.schema import FeatureSchema
from recaccel.models.factory import build_model
from recaccel.ops.backend import op_backends, resolve_backend
from recaccel.sparse import Batch
from recaccel.train.objectives import DLRMObjective
from recaccel.train.optim import build_dense_optimizer
from recaccel.train.parallel import SingleProcess

CANDIDATES = ("recaccel", "eager", "reference", "compiled")
PHASES = (
    "embedding_forward",
    "interaction",
    "mlps",
    "backward",
    "sparse_update",
    "dense_optimizer",
    "data_wait",
)
FUSED_SPARSE_UPDATE = "merged into backward (fused sparse optimizer)"


class PhaseTimer:
    """Wall time per phase of one step, the device synchronised around every phase.

    The synchronisations serialise host and device (no overlap between phases), so the
    instrumented step is slower than a plain one: its phases show where time goes, the
    throughput pass says how fast a step is.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[str, float]] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        self.steps.append(defaultdict(float))

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Adds the time of the ``with`` body to ``phase`` of the current step (ms)."""
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.steps[-1][phase] += (time.perf_counter() - start) * 1e3


@dataclass
class Candidate:
    """One way of training the preset's model.

    Attributes:
        name: one of :data:`CANDIDATES`.
        step: one training step on a batch; returns the loss (not read back).
        phased_step: the same step, each phase under the timer.
        merged: phase -> what it is part of, for phases not measured on their own.
        notes: what this candidate is, for the report.
    """

    name: str
    step: Callable[[Batch], Tensor]
    phased_step: Callable[[Batch, PhaseTimer], None]
    merged: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _bce(logits: Tensor, batch: Batch) -> Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, weight=batch.weights)


def recaccel_config(cfg: Config, name: str) -> Config:
    """The preset's config for the ``recaccel`` (auto backends) or ``reference`` candidate."""
    backend = "reference" if name == "reference" else "auto"
    model = dataclasses.replace(cfg.model, embedding_backend=backend, interaction_backend=backend)
    return dataclasses.replace(cfg, model=model)


def build_recaccel_model(cfg: Config, schema: FeatureSchema, device: torch.device, name: str) -> nn.Module:
    """recaccel's DLRM as the trainer builds it, for the ``recaccel`` or ``reference`` candidate."""
    cfg = recaccel_config(cfg, name)
    return build_model(cfg.model, cfg.optim, schema, device)


def recaccel_candidate(cfg: Config, schema: FeatureSchema, device: torch.device, name: str) -> Candidate:
    """The trainer's step on recaccel's model (``name``: ``recaccel`` or ``reference``)."""
    cfg = recaccel_config(cfg, name)
    model = build_model(cfg.model, cfg.optim, schema, device)
    model.train()
    objective = DLRMObjective(cfg, model, "bce")
    optimizer = build_dense_optimizer(model, cfg.optim)
    layout = SingleProcess(device)

    def step(batch: Batch) -> Tensor:
        return layout.train_step(objective, optimizer, batch)

    def phased_step(batch: Batch, timer: PhaseTimer) -> None:
        with timer("dense_optimizer"):
            optimizer.zero_grad(set_to_none=True)
        with timer("embedding_forward"):
            pooled = model.embed(batch.sparse)
        with timer("mlps"):
            dense = model.dense_arch(batch.dense)
        with timer("interaction"):
            features = model.interaction_arch(dense, pooled)
        with timer("mlps"):
            loss = _bce(model.over_arch(features), batch)
        with timer("backward"):
            loss.backward()
        with timer("dense_optimizer"):
            optimizer.step()

    embedding = model.sparse_arch.embedding
    interaction = resolve_backend(
        model.interaction_arch.backend,
        device,
        available=op_backends(InteractionBackend),
        op="dot_interaction",
    )
    backends = (
        f"embedding {getattr(embedding, 'backend', type(embedding).__name__)}, interaction {interaction}"
    )
    return Candidate(
        name,
        step,
        phased_step,
        merged={"sparse_update": FUSED_SPARSE_UPDATE},
        notes=[f"{name}: the trainer's step ({backends}; sparse {cfg.optim.sparse} fused into backward)"],
    )


def eager_candidate(
    cfg: Config,
    schema: FeatureSchema,
    device: torch.device,
    *,
    compile_backend: str | None = None,
) -> Candidate:
    """The hand-written DLRM's step; with ``compile_backend``, its dense part (MLPs,
    interaction, loss) goes through ``torch.compile(backend=compile_backend)``.

    torch.compile compiles on the first call: a failure (no C++ compiler, an
    unsupported op) surfaces in the first step, not here.
    """
    model = EagerDLRM(
        schema.sparse_names,
        schema.cardinalities,
        schema.num_dense,
        cfg.model.bottom_mlp,
        cfg.model.top_mlp,
        device,
    )
    model.train()
    tables = sparse_optimizer(model.embedding_parameters(), cfg.optim)
    dense_opt = build_dense_optimizer(model.head, cfg.optim)

    def head_loss(dense: Tensor, pooled: Tensor, labels: Tensor, weights: Tensor | None) -> Tensor:
        # Tensors only (no Batch object): torch.compile guards on what it is given.
        logits = model.head(dense, pooled)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels, weight=weights)

    if compile_backend is not None:
        head_loss = torch.compile(head_loss, backend=compile_backend, dynamic=False)

    def zero_grad() -> None:
        tables.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)

    def step(batch: Batch) -> Tensor:
        zero_grad()
        loss = head_loss(batch.dense, model.embed(batch.sparse), batch.labels, batch.weights)
        loss.backward()
        tables.step()
        dense_opt.step()
        return loss.detach()

    def phased_step(batch: Batch, timer: PhaseTimer) -> None:
        with timer("dense_optimizer"):
            zero_grad()
        with timer("embedding_forward"):
            pooled = model.embed(batch.sparse)
        if compile_backend is not None:
            with timer("mlps"):
                loss = head_loss(batch.dense, pooled, batch.labels, batch.weights)
        else:
            with timer("mlps"):
                dense = model.head.bottom(batch.dense)
            with timer("interaction"):
                features = model.head.interact(dense, pooled)
            with timer("mlps"):
                loss = _bce(model.head.top(features).squeeze(-1), batch)
        with timer("backward"):
            loss.backward()
        with timer("sparse_update"):
            tables.step()
        with timer("dense_optimizer"):
            dense_opt.step()

    name = "eager" if compile_backend is None else "compiled"
    what = (
        "per-table nn.EmbeddingBag(sparse=True) loop, bmm + triu gather interaction, "
        f"tables by {type(tables).__module__}.{type(tables).__name__}, MLPs by "
        f"{type(dense_opt).__module__}.{type(dense_opt).__name__}"
    )
    merged = {}
    if compile_backend is not None:
        merged["interaction"] = "merged into mlps (one compiled graph)"
        what = (
            f"eager with MLPs + interaction + loss under torch.compile(backend={compile_backend!r}); " + what
        )
    return Candidate(name, step, phased_step, merged=merged, notes=[f"{name}: {what}"])


def build_candidate(
    name: str, cfg: Config, schema: FeatureSchema, device: torch.device, compile_backend: str
) -> Candidate:
    """The candidate ``name`` (one of :data:`CANDIDATES`) for the preset's model."""
    if name in ("recaccel", "reference"):
        return recaccel_candidate(cfg, schema, device, name)
    return eager_candidate(
        cfg, schema, device, compile_backend=compile_backend if name == "compiled" else None
    )
