"""The candidates of ``recaccel-bench train``: one training step each, and the same step
split into phases for the instrumented pass.

- ``recaccel``: the trainer's own loop (:func:`recaccel.models.factory.build_model`, the
  DLRM objective, its layout's ``steps``: the
  :class:`~recaccel.train.loop.pipeline.BatchPipeline` and the step runner, all built by
  the trainer's own builders in :mod:`recaccel.bench.step.parts`) on auto backends, the sparse
  optimizer fused into the embedding's backward; one candidate per :class:`Combination`
  of ``train.pipeline``, ``train.micro_batches`` and ``train.cuda_graphs``;
- ``reference``: the same with the reference backends (``off/1/off`` only);
- ``eager``: :class:`~recaccel.bench.step.eager.EagerDLRM` with a torch optimizer for
  the tables and the dense one for the MLPs;
- ``compiled``: ``eager`` with its dense part (MLPs, interaction, loss) under
  ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import get_args

import torch
from torch import Tensor, nn

from recaccel.bench.step.eager import EagerDLRM, cross_shape, sparse_optimizer
from recaccel.bench.step.graphs import GRAPHS
from recaccel.bench.step.parts import TrainerParts, trainer_parts
from recaccel.bench.step.phased import (
    PhaseTimer,
    eager_phased_step,
    head_flops_per_sample,
    recaccel_phased_step,
)
from recaccel.config import Config, InteractionBackend, PipelineMode, Precision, TrainConfig
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema
from recaccel.models.factory import build_model
from recaccel.ops.backend import op_backends, resolve_backend
from recaccel.sparse import Batch
from recaccel.train.loop.parallel import StepDone
from recaccel.train.model.objectives import autocast
from recaccel.train.model.optim import build_dense_optimizer

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
PIPELINES: tuple[str, ...] = get_args(PipelineMode)


@dataclass(frozen=True)
class Combination:
    """One setting of the trainer's step options the ``recaccel`` candidate is timed under.

    Attributes:
        pipeline: ``train.pipeline``.
        micro_batches: ``train.micro_batches``.
        cuda_graphs: one of :data:`GRAPHS`: ``train.cuda_graphs`` off, or on with
            ``train.cuda_graph_scope`` head (``on``) or step (``step``).
    """

    pipeline: str = "off"
    micro_batches: int = 1
    cuda_graphs: str = "off"

    @property
    def label(self) -> str:
        """``pipeline/micro_batches/graphs``, e.g. ``sync/2/on``."""
        return f"{self.pipeline}/{self.micro_batches}/{self.cuda_graphs}"

    @property
    def key(self) -> tuple[str, int, str]:
        return self.pipeline, self.micro_batches, self.cuda_graphs

    def train_config(self, train: TrainConfig) -> TrainConfig:
        """``train`` with this combination's keys.

        Raises:
            ConfigError: the keys do not combine (``semi_sync`` with micro-batches).
        """
        return dataclasses.replace(
            train,
            pipeline=self.pipeline,
            micro_batches=self.micro_batches,
            cuda_graphs=self.cuda_graphs != "off",
            cuda_graph_scope="step" if self.cuda_graphs == "step" else "head",
        )


BASELINE = Combination()
"""``off/1/off``: the step without pipeline, micro-batches or graphs, what speedups are against."""


def _csv(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"train bench: {flag}={text!r} names nothing; give a comma-separated list")
    return items


def _pipeline(text: str) -> str:
    if text not in PIPELINES:
        raise ConfigError(f"train bench: --pipeline {text!r} is not one of {', '.join(PIPELINES)}")
    return text


def _micro_batches(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"train bench: --micro-batches {text!r} must be an integer >= 1")
    return int(text)


def _graphs(text: str) -> str:
    if text not in GRAPHS:
        raise ConfigError(f"train bench: --cuda-graphs {text!r} is not one of {', '.join(GRAPHS)}")
    return text


PRECISIONS: tuple[str, ...] = get_args(Precision)


def parse_precisions(text: str | None) -> list[Precision] | None:
    """The ``train.precision`` modes of ``--precision`` (comma-separated, in order, once
    each); None when not given (each preset's own mode).

    Raises:
        ConfigError: an unknown mode, naming the flag and the modes there are.
    """
    if text is None:
        return None
    modes = _csv(text, "--precision")
    for mode in modes:
        if mode not in PRECISIONS:
            raise ConfigError(f"train bench: --precision {mode!r} is not one of {', '.join(PRECISIONS)}")
    return list(dict.fromkeys(modes))


def with_precision(cfg: Config, precision: Precision) -> Config:
    """``cfg`` with ``train.precision = precision``."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))


def parse_combinations(
    pipelines: str, micro_batches: str, cuda_graphs: str, labels: str | None = None
) -> list[Combination]:
    """Every combination of the comma-separated lists, in the lists' order (the first
    list varies slowest), or the ``labels`` given; ``off/1/off`` always comes first (the
    speedups' baseline).

    Args:
        pipelines: of ``off``, ``sync``, ``semi_sync``.
        micro_batches: integers >= 1.
        cuda_graphs: of :data:`GRAPHS` (``off``, ``on``, ``step``).
        labels: comma-separated ``pipeline/micro_batches/graphs`` (``sync/2/on``); when
            given, the three lists are ignored.

    Raises:
        ConfigError: an unknown value, naming the flag.
    """
    if labels is not None:
        found = []
        for label in _csv(labels, "--combinations"):
            parts = label.split("/")
            if len(parts) != 3:
                raise ConfigError(
                    f"train bench: --combinations {label!r} is not pipeline/micro_batches/graphs (sync/2/on)"
                )
            found.append(Combination(_pipeline(parts[0]), _micro_batches(parts[1]), _graphs(parts[2])))
    else:
        found = [
            Combination(p, k, g)
            for p, k, g in itertools.product(
                [_pipeline(t) for t in _csv(pipelines, "--pipeline")],
                [_micro_batches(t) for t in _csv(micro_batches, "--micro-batches")],
                [_graphs(t) for t in _csv(cuda_graphs, "--cuda-graphs")],
            )
        ]
    return list(dict.fromkeys([BASELINE, *found]))


@dataclass
class Candidate:
    """One way of training the preset's model.

    Attributes:
        name: one of :data:`CANDIDATES`.
        step: one training step on a batch; returns the loss (not read back).
        phased_step: the same step, each phase under the timer.
        merged: phase -> what it is part of, for phases not measured on their own.
        notes: what this candidate is, for the report.
        head_flops: FLOP per sample of the dense head (MLPs and interaction, forward and
            backward) when its phases time the head alone (recaccel's ``off/1/off``).
    """

    name: str
    step: Callable[[Batch], Tensor]
    phased_step: Callable[[Batch, PhaseTimer], None] | None
    merged: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    steps: Callable[[Iterable[tuple[Batch, dict]]], Iterator[StepDone]] | None = None
    combination: Combination | None = None
    trainer: TrainerParts | None = None
    head_flops: float | None = None

    @property
    def key(self) -> str:
        """Unique among a preset's candidates: the name, and the combination unless it is ``off/1/off``."""
        if self.combination is None or self.combination == BASELINE:
            return self.name
        return f"{self.name} {self.combination.label}"

    def stepper(self, source) -> Callable[[], Tensor]:
        """One training step per call on ``source``'s batches (``RotatingBatches`` or
        ``ReaderBatches``): through the trainer's loop when the candidate has one (a fresh
        pipeline, pulling ``source.pairs()`` ahead as the trainer pulls its loader), else
        :attr:`step` on ``source.next()``."""
        if self.steps is None:
            return lambda: self.step(source.next())
        loop = self.steps(source.pairs())
        return lambda: next(loop).loss


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


def recaccel_candidates(
    cfg: Config,
    schema: FeatureSchema,
    device: torch.device,
    name: str,
    combinations: Sequence[Combination] = (BASELINE,),
) -> tuple[list[Candidate], dict[Combination, str]]:
    """The trainer's loop on recaccel's model, one candidate per combination
    (``name``: ``recaccel`` or ``reference``).

    The combinations share one model (tables and dense weights; each has its own head,
    dense optimizer and pipeline): a step's work does not depend on the weights' values,
    and 14 copies of a preset's tables would not fit one GPU.

    Returns:
        The candidates, and by combination the one-line reason of those that cannot run
        here.
    """
    cfg = recaccel_config(cfg, name)
    model = build_model(cfg.model, cfg.optim, schema, device)
    model.train()
    backends = _backends(model, device)
    built, skipped = [], {}
    for combination in combinations:
        try:
            parts = trainer_parts(
                dataclasses.replace(cfg, train=combination.train_config(cfg.train)), model, device
            )
        except ConfigError as e:
            skipped[combination] = str(e).splitlines()[0]
            continue
        built.append(_trainer_candidate(name, parts, combination, backends))
    return built, skipped


def _backends(model: nn.Module, device: torch.device) -> str:
    embedding = model.sparse_arch.embedding
    interaction = resolve_backend(
        model.interaction_arch.backend,
        device,
        available=op_backends(InteractionBackend),
        op="dot_interaction",
    )
    return f"embedding {getattr(embedding, 'backend', type(embedding).__name__)}, interaction {interaction}"


def _trainer_candidate(name: str, parts: TrainerParts, combination: Combination, backends: str) -> Candidate:
    """A candidate stepping through ``parts``' loop; the phase breakdown is of ``off/1/off``
    only (a pipelined step's phases overlap: the timeline shows them)."""

    def step(batch: Batch) -> Tensor:
        return next(parts.steps([(batch, {})])).loss

    return Candidate(
        name,
        step,
        recaccel_phased_step(parts.model, parts.optimizer, parts.train.precision, parts.layout.device)
        if combination == BASELINE
        else None,
        # off/1/off times the fused update on its own (phased.py); pipelined ones are not phased.
        merged={} if combination == BASELINE else {"sparse_update": FUSED_SPARSE_UPDATE},
        head_flops=head_flops_per_sample(parts.model) if combination == BASELINE else None,
        notes=[
            f"{name}: the trainer's loop, SingleProcess.steps (BatchPipeline + build_step + build_head; "
            f"{backends}; sparse {parts.objective.cfg.optim.sparse} fused into backward)"
        ],
        steps=parts.steps,
        combination=combination,
        trainer=parts,
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
        cross=cross_shape(cfg.model),
    )
    model.train()
    tables = sparse_optimizer(model.embedding_parameters(), cfg.optim)
    dense_opt = build_dense_optimizer(model.head, cfg.optim)

    precision = cfg.train.precision

    def head_loss(dense: Tensor, pooled: Tensor, labels: Tensor, weights: Tensor | None) -> Tensor:
        # Tensors only (no Batch object): torch.compile guards on what it is given.
        # The autocast of recaccel's objective (a fair baseline): inside, so compile traces it.
        with autocast(precision, device):
            logits = model.head(dense, pooled)
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels, weight=weights)

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

    name = "eager" if compile_backend is None else "compiled"
    phased_step = eager_phased_step(
        model, (tables, dense_opt), head_loss, (precision, device), compile_backend
    )
    merged, what = _eager_description(tables, dense_opt, compile_backend)
    return Candidate(name, step, phased_step, merged=merged, notes=[f"{name}: {what}"])


def _eager_description(
    tables: torch.optim.Optimizer, dense_opt: torch.optim.Optimizer, compile_backend: str | None
) -> tuple[dict[str, str], str]:
    """The eager candidate's merged phases and its line in the report."""
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
    return merged, what


def build_candidates(
    name: str,
    cfg: Config,
    schema: FeatureSchema,
    device: torch.device,
    compile_backend: str,
    combinations: Sequence[Combination] = (BASELINE,),
) -> tuple[list[Candidate], dict[Combination, str]]:
    """The candidate ``name`` (one of :data:`CANDIDATES`) for the preset's model: one per
    combination for ``recaccel`` (``reference`` runs ``off/1/off``), one for the others;
    and the reasons of combinations that cannot run here."""
    if name == "recaccel":
        return recaccel_candidates(cfg, schema, device, name, combinations)
    if name == "reference":
        return recaccel_candidates(cfg, schema, device, name)
    candidate = eager_candidate(
        cfg, schema, device, compile_backend=compile_backend if name == "compiled" else None
    )
    return [candidate], {}
