"""The model, optimizer, training and scale-out sections, and :class:`Config`, the whole run
(the data sections are in :mod:`recaccel.config.data`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from recaccel.config.checks import (
    Count,
    Fraction,
    GlobalSeed,
    Name,
    NamedPath,
    NonNegative,
    NonNegativeFloat,
    PathText,
    Pattern,
    Range,
    Rate,
    Section,
    TablePlacementText,
    field_hints,
    show_value,
)
from recaccel.config.data import DataConfig, SynthConfig, TasksConfig
from recaccel.config.vocabulary import (
    CLASS_PATH,
    AdaptMode,
    Arch,
    BestMode,
    CachePolicy,
    CudaGraphScope,
    DataSharding,
    DcnKernel,
    DenseOptimizer,
    DistBackend,
    EmbeddingBackend,
    EmbeddingDtype,
    EmbeddingPlacement,
    Interaction,
    InteractionBackend,
    InteractionPad,
    Logger,
    Loss,
    LRSchedule,
    MetaEngine,
    ParallelMode,
    PipelineMode,
    Pooling,
    Precision,
    ShardingKind,
    SparseOptimizer,
    StragglerPolicy,
    TrainMode,
)
from recaccel.errors import ConfigError


@dataclass
class ModelConfig(Section):
    """DLRM shape and which operator backends it runs on."""

    SECTION: ClassVar[str] = "model"

    arch: Arch = "dlrm"  # DLRM, or MeLU (item and user embeddings into one MLP; needs item_fields)
    embedding_dim: Count = 16  # D: width of every embedding row
    bottom_mlp: list[Count] = field(default_factory=lambda: [64, 16])  # dense MLP widths; the last is D
    top_mlp: list[Count] = field(default_factory=lambda: [64, 32, 1])  # after the interaction; ends in 1
    interaction: Interaction = "dot"  # pairwise dot products, or the DCN-v2 cross network
    dcn_layers: Count = 3  # dcnv2: cross layers
    dcn_rank: Count = 512  # dcnv2: rank r of each layer's U [K, r] V [r, K]
    dcn_kernel: DcnKernel = "gemm"  # dcnv2 on the triton backend: "gemm" | "fused" (one launch)
    # triton runs on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1)
    embedding_backend: EmbeddingBackend = "auto"
    interaction_backend: InteractionBackend = "auto"  # the interaction's kernels (auto: fastest available)
    interaction_pad: InteractionPad = "auto"  # dot: pad its output row to a multiple of 8
    pooling: Pooling = "sum"  # how a multi-hot field's rows combine into one vector
    # bf16/fp16: packed rows stored 16-bit, updated in fp32 with stochastic rounding
    embedding_dtype: EmbeddingDtype = "fp32"
    item_fields: list[Name] = field(default_factory=list)  # melu: the item attribute fields
    embedding_placement: EmbeddingPlacement = "device"  # of every table, unless table_placement says
    table_placement: list[TablePlacementText] = field(default_factory=list)  # "table=host" overrides
    cache_fraction: Fraction = 0.1  # host tables: the device cache's share of a pack's rows
    cache_rows: NonNegative = 0  # > 0: the cache's rows per pack (instead of cache_fraction)
    cache_lookahead: Count = 1  # k: batches whose rows are resident before the first's lookup
    cache_policy: CachePolicy = "lru"  # victims among rows no batch of the window needs
    # A model of your own, "package.module:Class" (importable: installed or on PYTHONPATH), built
    # as Class(cfg, schema, device, **init_args) instead of the DLRM above; "" = recaccel's model
    class_path: str = ""
    init_args: dict[str, Any] = field(default_factory=dict)  # class_path's keyword arguments: {hidden = 64}

    def check_consistency(self) -> None:
        if self.class_path and re.fullmatch(CLASS_PATH, self.class_path) is None:
            raise ConfigError(
                f"config key model.class_path={show_value(self.class_path)} must look like package.module:Class"
            )
        if self.init_args and not self.class_path:
            raise ConfigError(
                f"config key model.init_args={show_value(self.init_args)} is for model.class_path, which is unset"
            )


@dataclass
class OptimConfig(Section):
    """Dense optimizer for MLPs; sparse optimizer fused into the embedding backward."""

    SECTION: ClassVar[str] = "optim"

    dense: DenseOptimizer = "adam"  # optimizer of the MLPs and every parameter outside the embeddings
    lr: Rate = 1e-3  # the dense optimizer's learning rate
    weight_decay: NonNegativeFloat = 0.0  # the dense optimizer's L2 penalty
    sparse: SparseOptimizer = "rowwise_adagrad"  # optimizer of the embeddings, fused into their backward
    sparse_lr: Rate = 0.05  # the sparse optimizer's learning rate
    eps: NonNegativeFloat = 1e-8  # the denominators' epsilon of adam and adagrad
    # Learning-rate schedule of both optimizers (dense and sparse): linear warmup from 0
    # over warmup_steps, constant, then decay from decay_start over decay_steps to
    # final_lr_ratio * lr (linear, cosine, or polynomial of power poly_power as MLPerf's DLRM)
    schedule: LRSchedule = "constant"
    warmup_steps: NonNegative = 0  # steps of linear warmup from 0 (0 = none)
    decay_start: NonNegative = 0  # the step decay begins (0 = right after warmup)
    decay_steps: NonNegative = 0  # 0 = until the run's last step
    final_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.0  # the decay ends at this times lr
    poly_power: Rate = 2.0  # the exponent of the polynomial decay
    grad_clip_norm: NonNegativeFloat = 0.0  # > 0: clip the dense gradients' global L2 norm; 0 = off


@dataclass
class TrainConfig(Section):
    """The training loop."""

    SECTION: ClassVar[str] = "train"

    out_dir: PathText = "runs/debug"  # the run directory: config, log, metrics, checkpoints
    mode: TrainMode = "dlrm"  # plain training on rows, or meta-learning on tasks ([meta], [tasks])
    eval_tasks: bool = False  # dlrm mode: evaluate on task batches like a meta-learner
    epochs: Count = 1  # ignored when steps > 0
    steps: NonNegative = 0  # > 0: stop after this many steps (overrides epochs); 0 = run train.epochs
    loss: Literal["auto", Loss] = "auto"  # auto: from the data's label_kind
    eval_every: NonNegative = 0  # steps; 0 = only at the end
    checkpoint_every: NonNegative = 0  # steps; 0 = only at the end
    keep_checkpoints: Count = 2  # the newest step checkpoints kept (older ones are deleted)
    # A metric of the periodic evaluations ("auc", "logloss"): the checkpoint of its best
    # evaluation is kept as checkpoints/best.pt; "" = none
    best_metric: str = ""
    best_mode: BestMode = "auto"  # auto: min for names with loss, ne, mae, mse or rmse, else max
    # > 0: stop after this many periodic evaluations without a better best_metric; 0 = off
    early_stop_patience: NonNegative = 0
    log_every: Count = 50  # steps (the first step is always logged)
    seed: GlobalSeed = 0  # seeds the model's initialization and every generator a run draws from
    # auto: CUDA when present, else the CPU
    device: Annotated[str, Pattern(r"auto|cpu|cuda(:[0-9]+)?", "must be auto, cpu, cuda or cuda:N")] = "auto"
    progress: bool = True  # a progress bar on the console
    deterministic: bool = False  # deterministic kernels only (slower; same results on the same machine)
    # fp32: float32 math (TF32 off) | tf32: CUDA matmuls on TF32 tensor cores (fp32 on CPU) | bf16:
    # autocast for the MLPs and the interaction; loss, metrics, optimizer and embeddings stay fp32
    precision: Precision = "fp32"
    # off: one batch at a time | sync: the next batch prepared on a side stream while one trains
    # (the results of off) | semi_sync: also its embedding lookup, before this step's sparse update
    # (one step stale, opt-in) | overlap: the MLPs' weight gradients deferred until after backward,
    # so the sparse update runs as soon as the pooled gradient is known; then the next batch's
    # lookup (on a side stream on CUDA) runs alongside the weight gradients and the dense optimizer
    # step (the results of off, or with micro_batches of sync, bit for bit on CPU; dlrm mode,
    # packed fused embedding, one process; no cuda_graphs or compile)
    pipeline: PipelineMode = "off"
    micro_batches: Count = 1  # > 1: dense work per micro-batch, one sparse update per step (dlrm mode)
    cuda_graphs: bool = False  # capture the step in CUDA graphs, replayed per batch shape (CUDA)
    # what cuda_graphs = true captures: head (the dense head's forward and backward) | step (the whole
    # step, one graph: pipeline off or sync, fp32 device tables on Triton; a schedule with dense adam)
    cuda_graph_scope: CudaGraphScope = "head"
    compile: bool = False  # torch.compile the dense arches
    loggers: list[Logger] = field(default_factory=lambda: ["jsonl"])  # jsonl (log.jsonl) always written
    metric_window: NonNegative = 0  # > 0: train AUC and logloss over the last this many rows, at log steps
    # [first, last]: a profiler trace and timeline of these steps in the run directory; [] = off
    profile_steps: list[Count] = field(default_factory=list)

    def check_consistency(self) -> None:
        if self.mode == "meta" and self.pipeline in ("semi_sync", "overlap"):
            raise ConfigError(
                f"config key train.pipeline={self.pipeline} runs train.mode=dlrm (a meta step adapts on "
                "the lookup it makes); use train.pipeline=sync"
            )
        if self.mode == "meta" and self.micro_batches > 1:
            raise ConfigError(
                f"config key train.micro_batches={self.micro_batches} runs train.mode=dlrm "
                "(a meta step's tasks are its unit); use train.micro_batches=1"
            )
        if self.pipeline == "semi_sync" and self.micro_batches > 1:
            raise ConfigError(
                f"config keys train.pipeline=semi_sync and train.micro_batches={self.micro_batches} do not "
                "combine; use train.pipeline=sync with micro-batches"
            )
        self._check_overlap()
        self._check_graph_scope()
        self._check_best()
        self._check_profile()

    def _check_overlap(self) -> None:
        """overlap runs its weight gradients outside autograd: no CUDA graphs or compile."""
        if self.pipeline != "overlap":
            return
        on = {
            "cuda_graphs=true": self.cuda_graphs,
            "compile=true": self.compile,
        }
        for setting, refused in on.items():
            if refused:
                raise ConfigError(
                    f"config keys train.pipeline=overlap and train.{setting} do not "
                    "combine (its weight gradients run outside autograd); use train.pipeline=sync"
                )

    def _check_graph_scope(self) -> None:
        """A whole-step graph replays one batch through one step runner: pipeline off or sync
        (the lookup of semi_sync and overlap runs outside the step), no micro-batches."""
        if not (self.cuda_graphs and self.cuda_graph_scope == "step"):
            return  # without cuda_graphs the scope captures nothing (the trainer logs it)
        if self.pipeline not in ("off", "sync"):
            raise ConfigError(
                f"config keys train.cuda_graph_scope=step and train.pipeline={self.pipeline} do not combine "
                "(the whole step is one graph); use train.pipeline=sync"
            )
        if self.micro_batches > 1:
            raise ConfigError(
                f"config keys train.cuda_graph_scope=step and train.micro_batches={self.micro_batches} do not "
                "combine (the whole step is one graph); use train.micro_batches=1"
            )

    def _check_profile(self) -> None:
        """profile_steps is empty or [first, last] with first <= last."""
        steps = self.profile_steps
        if steps and (len(steps) != 2 or steps[0] > steps[1]):
            raise ConfigError(
                f"config key train.profile_steps={steps} must be [first, last] with first <= last, or []"
            )

    def _check_best(self) -> None:
        """best_metric needs periodic evaluations; early stopping needs best_metric."""
        if self.early_stop_patience > 0 and not self.best_metric:
            raise ConfigError(
                f"config key train.early_stop_patience={self.early_stop_patience} needs train.best_metric "
                '(the metric that must improve, e.g. "auc")'
            )
        if self.best_metric and self.eval_every == 0:
            raise ConfigError(
                f"config key train.best_metric={self.best_metric} needs periodic evaluations; "
                "set train.eval_every > 0"
            )


@dataclass
class MetaConfig(Section):
    """MAML-style meta-learning of the model head (``train.mode = "meta"``)."""

    SECTION: ClassVar[str] = "meta"

    inner_steps: NonNegative = 1  # 0 = no adaptation (the model as trained)
    inner_lr: Rate = 0.01  # the inner loop's learning rate
    first_order: bool = False  # first-order MAML (no second derivatives: faster, less memory)
    meta_sgd: bool = False  # learn per-parameter inner learning rates
    # adapted per task: the top MLP (top_mlp), the dense and top MLPs (head), or those and a
    # per-task shift of the pooled embeddings (head_and_embedding_shift)
    adapt: AdaptMode = "top_mlp"
    engine: MetaEngine = "batched"  # how the tasks run: stacked matmuls, torch.func, one by one
    eval_states: list[NamedPath] = field(default_factory=list)  # extra test sets, "name=path"


@dataclass
class ParallelConfig(Section):
    """Multi-process training: ``hybrid`` = TorchRec-sharded embeddings + data-parallel dense.

    Launch with ``recaccel-train --nproc N`` or ``torchrun --nproc-per-node N -m recaccel.cli``.
    ``sharding`` is every table's layout (``auto`` = TorchRec's planner chooses);
    ``table_sharding`` overrides it per table with ``"name=kind"`` entries (checked
    against the dataset's tables when the model is sharded). ``data``:
    ``global`` = every rank reads the global batch of ``data.batch_size`` rows (or
    ``tasks.tasks_per_batch`` tasks) and trains on its contiguous slice (same result as one
    process); ``sharded`` = each rank reads its own row groups in batches of
    ``data.batch_size`` (per rank) and all ranks stop an epoch when the first runs dry;
    ``dynamic`` = rank 0's shard service hands shards of ``data.shard_row_groups`` row
    groups to whichever rank asks, their states in the checkpoint
    (:mod:`recaccel.train.distributed.shard_service`).

    ``straggler`` (as AntDT; :mod:`recaccel.train.distributed.straggler`): ``rebalance``
    (``data = "global"``, dedicated clusters) splits every global batch over the ranks in
    proportion to their measured speed, re-decided every ``straggler_every`` steps;
    ``backup`` (``data = "dynamic"``, shared clusters) shrinks the local batch of a rank
    slower than ``backup_factor`` times the others' median to its speed share (its unread
    shard rows go back to the service for the faster ranks) while the others grow, the
    global batch kept. Either way each rank's loss counts by its share of the global
    normaliser, so the update is the equal-split one.
    """

    SECTION: ClassVar[str] = "parallel"

    mode: ParallelMode = "single"  # one process, or hybrid (see above)
    sharding: Literal["auto", ShardingKind] = "auto"  # every table's layout (see above)
    table_sharding: list[str] = field(default_factory=list)  # "name=kind" per table
    data: DataSharding = "global"  # how ranks read the data (see above)
    backend: DistBackend = "auto"  # auto: nccl on CUDA, else gloo
    timeout_s: Rate = 300.0  # a collective waiting longer than this fails the run
    straggler: StragglerPolicy = "off"  # slow ranks: see above
    straggler_every: Count = 5  # steps between the straggler controller's decisions
    backup_factor: Annotated[float, Range(gt=1)] = 1.5  # backup: slower than this x the others' median


@dataclass
class MonitorConfig(Section):
    """The communication monitor of hybrid runs: each rank times its steps' compute, its
    collectives and the bytes they move; every ``monitor.every`` steps rank 0 gathers them and
    flags a rank whose compute (or own collective time) exceeds ``slow_factor`` times the
    median of the other ranks' in ``slow_steps`` gathers in a row (a ``monitor`` event in
    log.jsonl, ``monitor`` in metrics.json). While it runs, a collective that fails names the
    ranks that never arrived at it. Every ``probe_every`` gathers, each pair of ranks times a
    ping-pong alone and a pair slower than ``slow_factor`` times the median pair in
    ``slow_steps`` probes in a row is flagged as a slow link.
    """

    SECTION: ClassVar[str] = "monitor"

    every: NonNegative = 0  # steps between gathers on rank 0; 0 = off
    slow_factor: Annotated[float, Range(gt=1)] = 2.0  # slow: above this times the other ranks' median
    slow_steps: Count = 3  # consecutive gathers a rank must be slow in to be flagged
    probe_every: NonNegative = 0  # gathers between link probes (a slow pair of ranks; W >= 3); 0 = off


@dataclass
class FaultConfig(Section):
    """Fault injection, for tests and demos only (stragglers, a rank failure and its resume).

    ``slow_rank`` makes that rank's own compute ``slow_factor`` times as long (it sleeps
    when its pooled embeddings' gradient is ready, before backward's all-to-all).
    ``kill_rank`` exits abruptly (``os._exit``, no clean-up, no checkpoint) right after
    training step ``kill_rank_at_step``; only in a run's first attempt: ranks that
    torchrun's agent restarted (``recaccel-train --max-restarts``,
    ``TORCHELASTIC_RESTART_COUNT`` > 0) resume from a checkpoint before that step and
    train past it instead of dying again. ``slow_pair = [a, b]`` delays the monitor's link
    probe between those ranks by ``slow_pair_delay_s`` per ping (``monitor.probe_every``).
    """

    SECTION: ClassVar[str] = "fault"

    slow_rank: Annotated[int, Range(ge=-1)] = -1  # -1 = none
    slow_factor: Annotated[float, Range(ge=1)] = 2.0  # the slow rank's compute time, times this
    kill_rank: NonNegative = 0  # the rank kill_rank_at_step ends
    kill_rank_at_step: NonNegative = 0  # 0 = never
    slow_pair: list[NonNegative] = field(default_factory=list)  # [a, b]: that pair's link probe is delayed
    slow_pair_delay_s: NonNegativeFloat = 0.02  # per ping of slow_pair's probe


@dataclass
class Config:
    """The whole run; each field is a section (checked when it is built)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        for name, cls in section_types().items():
            if not isinstance(getattr(self, name), cls):
                got = show_value(getattr(self, name))
                raise ConfigError(f"config section [{name}] must be a {cls.__name__}, got {got}")


def section_types() -> dict[str, type[Section]]:
    """Each section's name in a config file and its dataclass, in file order."""
    hints = field_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}
