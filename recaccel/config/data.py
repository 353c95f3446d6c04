"""The data sections: ``[synth]``, ``[data]`` with its ``[data.schema]`` mapping, ``[tasks]``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from recaccel.config.checks import (
    Count,
    Name,
    NonNegative,
    NonNegativeFloat,
    PathText,
    Range,
    Rate,
    Section,
    Seed,
    show_value,
)
from recaccel.config.vocabulary import (
    DenseTransformKind,
    InvalidDensePolicy,
    InvalidIdsPolicy,
    InvalidLabelsPolicy,
    LabelKind,
    LoaderBackend,
    ParquetCodec,
    TaskSplit,
    UnreadableFilesPolicy,
)
from recaccel.errors import ConfigError


@dataclass
class SynthConfig(Section):
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
class SparseColumn(Section):
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
class DenseTransform(Section):
    """How one dense column of a ``[data.schema]`` mapping is transformed as it is read, in
    training, evaluation and serving alike: ``log1p`` is sign(x) log(1 + |x|),
    ``standardize`` is (x - mean) / std with the statistics recaccel-data inspect computed.
    """

    SECTION: ClassVar[str] = "data.schema.transforms.COLUMN"

    transform: DenseTransformKind = "none"  # log1p, standardize, or none (the value as read)
    mean: float = 0.0  # standardize: the column's mean
    std: Rate = 1.0  # standardize: the column's standard deviation


@dataclass
class SchemaMapping(Section):
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
class DataConfig(Section):
    """Where training data lives and how it is read.

    Bad-input policies: ``error`` raises naming file, column and row group; ``skip``
    drops the row and counts it; ``clip`` clamps ids into range; ``hash`` maps ids
    modulo the cardinality; ``zero`` replaces NaN/inf dense values by 0.
    """

    SECTION: ClassVar[str] = "data"

    train: PathText = "data/synth/train"  # a .parquet file, a folder of them, or a cache folder
    test: PathText = "data/synth/test"  # evaluation data: .parquet file(s) or a cache folder
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
    # any count; 0 = in the training process; auto = 0 on a CPU device or for data of under
    # 4 shuffle buffers, on a GPU half the cores shared by the host's ranks, at most 8. Raise
    # it while data_wait_fraction falls
    workers: NonNegative | Literal["auto"] = "auto"
    prefetch: NonNegative = 2  # batches prepared ahead on a thread; 0 = inline
    loader_backend: LoaderBackend = "torch"  # host-to-device stage
    shard_row_groups: Count = 1  # parallel.data=dynamic: row groups per shard handed out
    # columns of files without recaccel schema metadata ([data.schema] below); unset = the metadata's
    schema: SchemaMapping | None = None


@dataclass
class TasksConfig(Section):
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
