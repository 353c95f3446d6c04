"""The vocabulary of every config choice: one ``typing.Literal`` alias per choice, and
:func:`choices` to read its values."""

from __future__ import annotations

import typing
from typing import Any, Literal

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
# | overlap: weight gradients deferred, the next lookup after the sparse update (exact)
PipelineMode = Literal["off", "sync", "semi_sync", "overlap"]
LRSchedule = Literal["constant", "linear", "cosine", "polynomial"]
# What train.cuda_graphs captures: head: the dense head's forward and backward | step: the whole
# training step (preparation, lookup, head, backward with the sparse update, dense optimizer)
CudaGraphScope = Literal["head", "step"]
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
