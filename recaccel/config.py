"""Typed configuration: one dataclass per component, loaded from TOML.

A config file has one table per section (``[data]``, ``[model]``, ...). Overrides use
``section.key=value`` where the value is TOML (``train.steps=100``,
``model.top_mlp=[64,1]``, ``model.embedding_backend=reference``).

Every field is checked where it is declared: its annotation says its type, its choices
(``typing.Literal``), its range (``Annotated[int, Range(ge=1)]``) or its form
(``Annotated[str, Pattern(...)]``); floats must be finite. Each section's
``__post_init__`` checks its fields against these annotations, so a section built from
TOML, from overrides or in Python is checked the same way. Every problem is one
:class:`ConfigError` line naming the key as ``section.key=value``. A zero that means
something is documented at its field (``train.steps = 0``: run ``train.epochs``);
other values outside a field's range are refused. :func:`recaccel.preflight.preflight`
checks what only the file system and the machine can say (input paths, the run
directory, the backends) before a run starts.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from recaccel.config_checks import (  # noqa: F401  (re-exported: recaccel.config's API)
    Count,
    Fraction,
    Name,
    NamedPath,
    NonNegative,
    NonNegativeFloat,
    PathText,
    Pattern,
    Range,
    Rate,
    Section,
    Seed,
    TablePlacementText,
    check_value,
    field_hints,
    show_value,
    suggest,
)
from recaccel.config_files import (  # noqa: F401  (path_fields: API)
    merge_tables,
    path_fields,
    read_toml,
    resolve_paths,
)
from recaccel.config_files import parse_override as _parse_override
from recaccel.config_files import toml_value as _toml_value
from recaccel.errors import ConfigError

_Section = Section  # the sections' base, checked field by field (recaccel.config_checks)

# The vocabulary of every choice, named once. Config fields use these aliases; components
# that take one of these values check it against ``choices(alias)`` rather than a tuple
# of their own.
ParquetCodec = Literal["snappy", "lz4", "zstd", "gzip", "none"]  # pyarrow names
InvalidIdsPolicy = Literal["error", "skip", "clip", "hash"]
InvalidDensePolicy = Literal["error", "skip", "zero"]
InvalidLabelsPolicy = Literal["error", "skip"]
# a data folder's *.parquet entries that cannot be read (dangling symlink, no permission, not
# a regular file, a name that is not UTF-8): skipped with one warning | refused
UnreadableFilesPolicy = Literal["warn", "error"]
LoaderBackend = Literal["torch", "dali"]
Arch = Literal["dlrm", "melu"]
Interaction = Literal["dot", "dcnv2"]
EmbeddingBackend = Literal["auto", "reference", "triton", "fbgemm", "per_table"]
InteractionBackend = Literal["auto", "reference", "triton"]
# dcnv2 on the triton backend: library GEMMs + one fused elementwise kernel per layer | all
# layers in one fused launch (recaccel.ops.interaction.CROSS_KERNELS)
DcnKernel = Literal["gemm", "fused"]
# dot interaction: zero-pad its output row to a multiple of 8 elements for the top MLP's
# first GEMM (auto: on with the triton interaction on CUDA); parameters are unchanged
InteractionPad = Literal["auto", "on", "off"]
CLASS_PATH = r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"  # model.class_path: package.module:Class
Pooling = Literal["sum", "mean"]
# device: rows and optimizer state on the training device | host: in pinned host memory,
# a device cache of the rows the next batches need
EmbeddingPlacement = Literal["device", "host"]
CachePolicy = Literal["lru", "lfu"]  # victims beyond the lookahead window
EmbeddingDtype = Literal["fp32", "bf16", "fp16"]  # packed embedding rows (optimizer state stays fp32)
# fp32: float32 math (TF32 off) | tf32: float32 tensors, CUDA matmuls on TF32 tensor cores (fp32
# on CPU) | bf16: autocast for the MLPs and the interaction (meta mode: the inner loop too)
Precision = Literal["fp32", "tf32", "bf16"]
# off: one batch at a time | sync: the next batch prepared on a side stream while one trains
# (same results) | semi_sync: also its embedding lookup, before this step's sparse update
# (one step stale, opt-in)
PipelineMode = Literal["off", "sync", "semi_sync"]
LRSchedule = Literal["constant", "linear", "cosine", "polynomial"]
# jsonl: log.jsonl (always written) | tensorboard: scalars and the hyperparameters |
# csv: metrics.csv, a row per log step | wandb, mlflow: need their packages installed
Logger = Literal["jsonl", "tensorboard", "csv", "wandb", "mlflow"]
BestMode = Literal["max", "min", "auto"]  # is a larger or a smaller train.best_metric better
DenseOptimizer = Literal["adam", "sgd", "adagrad"]
SparseOptimizer = Literal["sgd", "rowwise_adagrad", "adam"]
TrainMode = Literal["dlrm", "meta"]
Loss = Literal["bce", "mse"]  # BCE on logits (binary labels) | squared error (ratings)
LabelKind = Literal["binary", "rating"]  # a dataset's labels: clicks {0, 1} | real-valued ratings
DenseTransformKind = Literal["none", "log1p", "standardize"]  # a [data.schema] dense column, as read
TaskSplit = Literal["random", "time"]
AdaptMode = Literal["top_mlp", "head", "head_and_embedding_shift"]
MetaEngine = Literal["batched", "vmap", "loop"]  # stacked bmm | torch.func | per-task baseline
ParallelMode = Literal["single", "hybrid"]
ShardingKind = Literal["table_wise", "row_wise", "column_wise", "data_parallel"]
DataSharding = Literal["global", "sharded", "dynamic"]
StragglerPolicy = Literal["off", "rebalance", "backup"]
DistBackend = Literal["auto", "nccl", "gloo"]
# Converter options (recaccel-data), not config fields.
BadRowsPolicy = Literal["error", "skip"]  # criteo: a bad line raises, or is dropped and counted
MovieLensScenario = Literal["new_users", "new_items", "new_users_items", "time"]  # cold-start split


def choices(alias: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` choice alias, in declaration order."""
    return typing.get_args(alias)


PARQUET_CODECS: tuple[str, ...] = choices(ParquetCodec)


@dataclass
class SynthConfig(_Section):
    """Synthetic Criteo-like data with a planted ground-truth model (``recaccel-data synth``)."""

    SECTION: ClassVar[str] = "synth"

    out_dir: PathText = "data/synth"  # train/ and test/ are written inside
    train_rows: Count = 200_000  # rows of the training split
    test_rows: Count = 20_000  # rows of the test split (the same whatever train_rows)
    num_dense: NonNegative = 13  # dense features per row
    num_sparse: NonNegative = 26  # sparse fields per row
    cardinality: Count = 1000  # ids per sparse field
    cardinalities: list[Count] = field(default_factory=list)  # per field; [] = cardinality for all
    multi_hot_fields: NonNegative = 0  # the last k fields are multi-hot bags
    max_bag: Count = 5  # multi-hot fields: bags of 1..max_bag ids
    # per multi-hot field, a fixed bag size (as MLPerf's multi-hot Criteo); [] = uniform in 1..max_bag
    bag_sizes: list[Count] = field(default_factory=list)
    zipf_a: NonNegativeFloat = 1.2  # skew of the ids (Zipf exponent; 0 = uniform)
    signal_dim: Count = 4  # width of the planted model's latent vectors
    signal_scale: NonNegativeFloat = 1.0  # scale of the planted logit; larger = easier task
    rows_per_row_group: Count = 8192  # rows per Parquet row group
    rows_per_file: Count = 100_000  # rows per Parquet file
    compression: ParquetCodec = "snappy"  # Parquet codec of the files written
    seed: Seed = 0  # the data is a deterministic function of the config and this seed

    def check_consistency(self) -> None:
        if self.num_dense + self.num_sparse == 0:
            raise ConfigError("config keys synth.num_dense=0 and synth.num_sparse=0: need at least one field")
        if self.cardinalities and len(self.cardinalities) != self.num_sparse:
            raise ConfigError(
                f"config key synth.cardinalities={show_value(self.cardinalities)} has {len(self.cardinalities)} "
                f"entries, expected synth.num_sparse={self.num_sparse}"
            )
        if self.multi_hot_fields > self.num_sparse:
            raise ConfigError(
                f"config key synth.multi_hot_fields={self.multi_hot_fields} must be <= "
                f"synth.num_sparse={self.num_sparse}"
            )
        if self.bag_sizes and len(self.bag_sizes) != self.multi_hot_fields:
            raise ConfigError(
                f"config key synth.bag_sizes={show_value(self.bag_sizes)} has {len(self.bag_sizes)} entries, "
                f"expected synth.multi_hot_fields={self.multi_hot_fields}"
            )


@dataclass
class SparseColumn(_Section):
    """One sparse field of a ``[data.schema]`` mapping: a column holding one id per row,
    or a list of ids per row (a multi-hot bag; read from the column's Arrow type).

    Exactly one of ``cardinality`` (integer ids ``0 .. cardinality-1``; others follow
    ``data.invalid_ids``), ``hash`` (integer or string ids hashed into that many
    buckets) and ``vocabulary`` (an exact map of every value ``recaccel-data inspect``
    saw to its own row, unseen values to row 0) is set; ``vocabulary = "auto"`` with
    ``hash = N`` takes the column's vocabulary where the vocabulary file holds one (inspect
    writes them below its distinct-count limit), else hashes.
    """

    SECTION: ClassVar[str] = "data.schema.sparse.COLUMN"

    cardinality: NonNegative = 0  # integer ids 0..N-1, a table of N rows
    hash: NonNegative = 0  # ids (integers or strings) hashed into N rows
    # exact map value -> row 1..K from data.schema.vocabulary_file, unseen values share row 0;
    # "auto" (with hash = N): that map where the file holds one for the column, else the hash
    vocabulary: bool | Literal["auto"] = False
    min_count: Count = 1  # vocabulary: values seen fewer times in the inspected files go to row 0


@dataclass
class DenseTransform(_Section):
    """How one dense column of a ``[data.schema]`` mapping is transformed as it is read, in
    training, evaluation and serving alike: ``log1p`` is sign(x) log(1 + |x|),
    ``standardize`` is (x - mean) / std with the statistics recaccel-data inspect computed.
    """

    SECTION: ClassVar[str] = "data.schema.transforms.COLUMN"

    transform: DenseTransformKind = "none"  # log1p, standardize, or none (the value as read)
    mean: float = 0.0  # standardize: the column's mean
    std: Rate = 1.0  # standardize: the column's standard deviation


@dataclass
class SchemaMapping(_Section):
    """``[data.schema]``: which columns of any Parquet file are the label, the features and
    the task key, for data written without recaccel's schema metadata (see docs/data.md).

    Columns are named as in the files; ``sparse`` maps each sparse column, in order, to a
    :class:`SparseColumn` (``sparse.item = {hash = 100000}``).
    """

    SECTION: ClassVar[str] = "data.schema"

    label: Name = "label"  # the label column
    label_kind: LabelKind = "binary"  # clicks in {0, 1} (binary) or real-valued ratings
    dense: list[Name] = field(default_factory=list)  # the dense feature columns, in order
    sparse: dict[str, SparseColumn] = field(default_factory=dict)  # sparse column -> how its ids map to rows
    task_key: Name | None = None  # meta data: integer column grouping rows into tasks
    timestamp: Name | None = None  # meta data: integer or timestamp column ordering rows in time
    # the vocabularies (JSON) recaccel-data inspect --write-schema wrote, for vocabulary = true
    vocabulary_file: PathText | None = None
    # its SHA-256 as inspect wrote it: a vocabulary file changed since is refused, never remapped
    vocabulary_sha256: str | None = None
    # dense column -> {transform = "log1p" or "standardize" (with mean, std) or "none"}
    transforms: dict[str, DenseTransform] = field(default_factory=dict)

    def check_consistency(self) -> None:
        for name, col in self.sparse.items():
            key = f"config key data.schema.sparse.{name}"
            auto = col.vocabulary == "auto"
            if (col.cardinality > 0) + (col.hash > 0) + (col.vocabulary is True) != 1 or (
                auto and col.cardinality
            ):
                raise ConfigError(
                    f"{key}={show_value(dataclasses.asdict(col))} needs exactly one of cardinality = N "
                    "(integer ids 0..N-1), hash = N (ids hashed into N buckets) and vocabulary = true "
                    '(vocabulary = "auto" goes with hash = N)'
                )
            if col.vocabulary is True and self.vocabulary_file is None:
                raise ConfigError(
                    f"{key} has vocabulary = true but data.schema.vocabulary_file is not set "
                    "(recaccel-data inspect --write-schema writes both)"
                )
        unknown = sorted(set(self.transforms) - set(self.dense))
        if unknown:
            raise ConfigError(
                f"config key data.schema.transforms names {unknown}, not data.schema.dense columns"
            )
        if not self.dense and not self.sparse:
            raise ConfigError(
                "config key data.schema maps no feature: give data.schema.dense or data.schema.sparse"
            )
        roles = [self.label, *self.dense, *self.sparse, self.task_key, self.timestamp]
        names = [n for n in roles if n is not None]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"config key data.schema names column(s) {twice} in more than one role")


@dataclass
class DataConfig(_Section):
    """Where training data lives and how it is read.

    Bad-input policies: ``error`` raises naming file, column and row group; ``skip``
    drops the row and counts it; ``clip`` clamps ids into range; ``hash`` maps ids
    modulo the cardinality; ``zero`` replaces NaN/inf dense values by 0.
    """

    SECTION: ClassVar[str] = "data"

    train: PathText = "data/synth/train"  # a .parquet file or a folder of them
    test: PathText = "data/synth/test"  # the evaluation data: a .parquet file or a folder of them
    batch_size: Count = 512  # training rows per step (the global batch in hybrid mode, data = "global")
    eval_batch_size: Count = 4096  # rows per evaluation batch (memory only: metrics do not depend on it)
    shuffle: bool = True  # visit row groups in a seeded random order and mix rows in a shuffle buffer
    shuffle_buffer_rows: Count = 65_536  # rows mixed at a time when shuffle is on (more: better mixing)
    seed: Seed = 0  # seeds the shuffle order (each epoch draws its own from it)
    invalid_ids: InvalidIdsPolicy = "error"  # a sparse id outside its table: see the policies above
    invalid_dense: InvalidDensePolicy = "error"  # a NaN or infinite dense value: see the policies above
    invalid_labels: InvalidLabelsPolicy = "error"  # a missing or out-of-range label: see the policies above
    unreadable_files: UnreadableFilesPolicy = "warn"  # unreadable *.parquet in a folder: skip, warn | refuse
    drop_last: bool = True  # drop an epoch's last batch when it has fewer than batch_size rows
    read_ahead: NonNegative = 2  # shuffle buffers decoded ahead, one worker thread each; 0 = inline
    # reader processes decoding batches in parallel, with the same batches, order and resume for
    # any count; 0 = in the training process. On a 16-core GPU host start at 8 and raise it
    # while the run's data_wait_fraction falls
    workers: NonNegative = 0
    prefetch: NonNegative = 2  # batches prepared ahead on a thread; 0 = inline
    loader_backend: LoaderBackend = "torch"  # host-to-device stage
    shard_row_groups: Count = 1  # parallel.data=dynamic: row groups per shard handed out
    # columns of files without recaccel schema metadata ([data.schema] below); unset = the metadata's
    schema: SchemaMapping | None = None


@dataclass
class ModelConfig(_Section):
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
class OptimConfig(_Section):
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
class TrainConfig(_Section):
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
    seed: Seed = 0  # seeds the model's initialization and every generator a run draws from
    # auto: CUDA when present, else the CPU
    device: Annotated[str, Pattern(r"auto|cpu|cuda(:[0-9]+)?", "must be auto, cpu, cuda or cuda:N")] = "auto"
    progress: bool = True  # a progress bar on the console
    deterministic: bool = False  # deterministic kernels only (slower; same results on the same machine)
    # fp32: float32 math (TF32 off) | tf32: CUDA matmuls on TF32 tensor cores (fp32 on CPU) | bf16:
    # autocast for the MLPs and the interaction; loss, metrics, optimizer and embeddings stay fp32
    precision: Precision = "fp32"
    # off: one batch at a time | sync: the next batch prepared on a side stream while one trains
    # (the results of off) | semi_sync: also its embedding lookup, before this step's sparse update
    # (one step stale, opt-in)
    pipeline: PipelineMode = "off"
    micro_batches: Count = 1  # > 1: dense work per micro-batch, one sparse update per step (dlrm mode)
    cuda_graphs: bool = False  # capture the dense part of the step in CUDA graphs (CUDA, fixed shapes)
    compile: bool = False  # torch.compile the dense arches
    loggers: list[Logger] = field(default_factory=lambda: ["jsonl"])  # jsonl (log.jsonl) always written
    metric_window: NonNegative = 0  # > 0: train AUC and logloss over the last this many rows, at log steps
    # [first, last]: a profiler trace and timeline of these steps in the run directory; [] = off
    profile_steps: list[Count] = field(default_factory=list)

    def check_consistency(self) -> None:
        if self.mode == "meta" and self.pipeline == "semi_sync":
            raise ConfigError(
                "config key train.pipeline=semi_sync runs train.mode=dlrm (a meta step adapts on the "
                "lookup it makes); use train.pipeline=sync"
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
        self._check_best()
        self._check_profile()

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
class TasksConfig(_Section):
    """Meta-IO: how rows are grouped into tasks with support and query sets."""

    SECTION: ClassVar[str] = "tasks"

    tasks_per_batch: Count = 32  # T
    support_size: Count = 32  # S (rows beyond it are sampled away; fewer are padded)
    query_size: Count = 32  # Q
    min_task_rows: Count = 4  # smaller tasks are skipped and counted
    split: TaskSplit = "random"  # a task's query rows: drawn at random, or its latest by time
    # Share of a task's rows that goes to the query set; 0 = query_size rows (used only
    # when query_count is 0).
    query_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.5
    query_count: NonNegative = 0  # > 0: exactly this many query rows, the rest support (MeLU: 10)
    shuffle_buffer_tasks: Count = 1024  # tasks mixed at a time when data.shuffle is on
    unit_row_groups: Count = 4  # consecutive row groups dealt to a rank together
    read_ahead: NonNegative = 2  # units decoded ahead, one worker thread each; 0 = inline


@dataclass
class MetaConfig(_Section):
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
class ParallelConfig(_Section):
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
class MonitorConfig(_Section):
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
class FaultConfig(_Section):
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


def section_types() -> dict[str, type[_Section]]:
    """Each section's name in a config file and its dataclass, in file order."""
    hints = field_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def load_config(
    path: str | Path | Sequence[str | Path] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    paths_relative_to_file: bool = True,
) -> Config:
    """Loads TOML config files, merged left to right, and applies ``section.key=value`` overrides.

    Files merge table by table and key by key (nested tables such as ``[data.schema]``
    too): a later file's value replaces an earlier one's, a list is replaced whole, keys
    it does not give are kept. Overrides apply after every file.

    Paths: a path-valued key (:func:`path_fields`: ``data.train``, ``data.test``,
    ``train.out_dir``, ``synth.out_dir``, the paths of ``meta.eval_states``...) written
    relative in a file is relative to that file's folder, and comes back absolute;
    override values and defaults are left as given (relative to the working directory).

    Args:
        path: a config file, several (merged left to right), or None (the defaults).
        overrides: ``section.key=value`` items, the value in TOML (a bare word is a string).
        paths_relative_to_file: False reads a file's paths as written, relative to the
            working directory: how a run directory's own config.toml is read (see
            :func:`recaccel.api.run_config`), since runs before this rule wrote them so.

    Raises:
        ConfigError: on a missing, unreadable or non-UTF-8 file, a TOML syntax error, a
            section that is not a table, an unknown key or a bad value.
    """
    if path is None:
        files: list[Path] = []
    elif isinstance(path, (str, Path)):
        files = [Path(path)]
    else:
        files = [Path(p) for p in path]
    raw: dict[str, Any] = {}
    for file in files:
        values = _read_toml(file)
        if paths_relative_to_file:
            values = resolve_paths(values, file.parent.resolve(), section_types())
        merge_tables(raw, values)
    for item in overrides:
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Builds a :class:`Config` from nested dicts, checking every key and value.

    Raises:
        ConfigError: naming the first unknown section or key, or bad value.
    """
    _check_tables(raw)
    built = {}
    for section, values in raw.items():
        cls = section_types()[section]
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(f"unknown config key {section}.{key}{suggest(key, names, section + '.')}")
        built[section] = cls(**values)
    return Config(**built)


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: Config) -> str:
    """Serializes a resolved config as TOML (it loads back to an equal Config)."""
    lines: list[str] = []
    for section, values in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue  # TOML has no null; None fields default to None on load
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _read_toml(p: Path) -> dict[str, Any]:
    raw = read_toml(p)
    _check_tables(raw, f"config file {p}: ")
    return raw


def _check_tables(raw: dict[str, Any], where: str = "") -> None:
    """Every top-level key of a config must be a known section holding a table."""
    sections = section_types()
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(f"{where}unknown config section [{section}]{suggest(section, sections)}")
        if not isinstance(values, dict):
            raise ConfigError(
                f"{where}config section [{section}] must be a table of keys ([{section}] and the keys "
                f"below it), got {section} = {show_value(values)}"
            )
