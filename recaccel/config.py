"""Typed configuration: one dataclass per component, loaded from TOML.

A config file has one table per section (``[data]``, ``[model]``, ...). Overrides use
``section.key=value`` where the value is TOML (``train.steps=100``,
``model.top_mlp=[64,1]``, ``model.embedding_backend=reference``). Unknown keys and
ill-typed values raise :class:`ConfigError` naming the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recaccel.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class SynthConfig:
    """Synthetic Criteo-like data with a planted ground-truth model (``recaccel-data synth``)."""

    out_dir: str = "data/synth"
    train_rows: int = 200_000
    test_rows: int = 20_000
    num_dense: int = 13
    num_sparse: int = 26
    cardinality: int = 1000
    cardinalities: list[int] = field(default_factory=list)  # per field; overrides `cardinality`
    multi_hot_fields: int = 0  # the last k fields are multi-hot bags
    max_bag: int = 5
    zipf_a: float = 1.2
    signal_dim: int = 4
    signal_scale: float = 1.0  # scale of the planted logit; larger = easier task
    rows_per_row_group: int = 8192
    rows_per_file: int = 100_000
    compression: str = "snappy"  # Parquet codec, one of PARQUET_CODECS
    seed: int = 0


@dataclass
class DataConfig:
    """Where training data lives and how it is read.

    Bad-input policies: ``error`` raises naming file, column and row group; ``skip``
    drops the row and counts it; ``clip`` clamps ids into range; ``hash`` maps ids
    modulo the cardinality; ``zero`` replaces NaN/inf dense values by 0.
    """

    train: str = "data/synth/train"
    test: str = "data/synth/test"
    batch_size: int = 512
    eval_batch_size: int = 4096
    shuffle: bool = True
    shuffle_buffer_rows: int = 65_536
    seed: int = 0
    invalid_ids: str = "error"  # error | skip | clip | hash
    invalid_dense: str = "error"  # error | skip | zero
    invalid_labels: str = "error"  # error | skip
    drop_last: bool = True
    read_ahead: int = 2  # shuffle buffers decoded ahead, one worker thread each
    prefetch: int = 2
    loader_backend: str = "torch"  # torch | dali (host-to-device stage)


@dataclass
class ModelConfig:
    """DLRM shape and which operator backends it runs on."""

    arch: str = "dlrm"  # dlrm | melu
    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 32, 1])
    interaction: str = "dot"
    embedding_backend: str = "auto"  # auto | reference | triton | fbgemm | per_table
    interaction_backend: str = "auto"  # auto | reference | triton
    pooling: str = "sum"  # sum | mean
    item_fields: list[str] = field(default_factory=list)  # melu: the item attribute fields


@dataclass
class OptimConfig:
    """Dense optimizer for MLPs; sparse optimizer fused into the embedding backward."""

    dense: str = "adam"  # adam | sgd | adagrad
    lr: float = 1e-3
    weight_decay: float = 0.0
    sparse: str = "rowwise_adagrad"  # sgd | rowwise_adagrad | adam
    sparse_lr: float = 0.05
    eps: float = 1e-8


@dataclass
class TrainConfig:
    """The training loop."""

    out_dir: str = "runs/debug"
    mode: str = "dlrm"  # dlrm | meta
    eval_tasks: bool = False  # dlrm mode: evaluate on task batches like a meta-learner
    epochs: int = 1
    steps: int = 0  # > 0: stop after this many steps (overrides epochs)
    loss: str = "auto"  # auto (from label_kind) | bce | mse
    eval_every: int = 0  # steps; 0 = only at the end
    checkpoint_every: int = 0  # steps; 0 = only at the end
    log_every: int = 50
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True
    deterministic: bool = False


@dataclass
class TasksConfig:
    """Meta-IO: how rows are grouped into tasks with support and query sets."""

    tasks_per_batch: int = 32  # T
    support_size: int = 32  # S (rows beyond it are sampled away; fewer are padded)
    query_size: int = 32  # Q
    min_task_rows: int = 4  # smaller tasks are skipped and counted
    split: str = "random"  # random | time
    query_fraction: float = 0.5  # share of a task's rows that goes to the query set
    query_count: int = 0  # > 0: exactly this many query rows, the rest support (MeLU: 10)
    shuffle_buffer_tasks: int = 1024
    unit_row_groups: int = 4  # consecutive row groups dealt to a rank together
    read_ahead: int = 2  # units decoded ahead, one worker thread each


@dataclass
class MetaConfig:
    """MAML-style meta-learning of the model head (``train.mode = "meta"``)."""

    inner_steps: int = 1
    inner_lr: float = 0.01
    first_order: bool = False
    meta_sgd: bool = False  # learn per-parameter inner learning rates
    adapt: str = "top_mlp"  # top_mlp | head | head_and_embedding_shift
    engine: str = "batched"  # batched (stacked bmm) | vmap (torch.func) | loop (per-task baseline)
    eval_states: list[str] = field(default_factory=list)  # extra test sets, "name=path"


@dataclass
class ParallelConfig:
    """Multi-process training: ``hybrid`` = TorchRec-sharded embeddings + data-parallel dense.

    Launch with ``recaccel-train --nproc N`` or ``torchrun --nproc-per-node N -m recaccel.cli``.
    ``sharding`` is every table's layout (``auto`` = TorchRec's planner chooses);
    ``table_sharding`` overrides it per table with ``"name=kind"`` entries. ``data``:
    ``global`` = every rank reads the global batch of ``data.batch_size`` rows (or
    ``tasks.tasks_per_batch`` tasks) and trains on its contiguous slice (same result as one
    process); ``sharded`` = each rank reads its own row groups in batches of
    ``data.batch_size`` (per rank) and all ranks stop an epoch when the first runs dry.
    """

    mode: str = "single"  # single | hybrid
    sharding: str = "auto"  # auto | table_wise | row_wise | column_wise | data_parallel
    table_sharding: list[str] = field(default_factory=list)  # "name=kind" per table
    data: str = "global"  # global | sharded
    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | nccl | gloo
    timeout_s: float = 300.0  # a collective waiting longer than this fails the run


@dataclass
class Config:
    """The whole run."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# Parquet codecs recaccel's writers accept (pyarrow names).
PARQUET_CODECS = ("snappy", "lz4", "zstd", "gzip", "none")

# Keys whose value must be one of a few words; checked when a config is built.
CHOICES: dict[str, tuple[str, ...]] = {
    "data.invalid_ids": ("error", "skip", "clip", "hash"),
    "data.invalid_dense": ("error", "skip", "zero"),
    "data.invalid_labels": ("error", "skip"),
    "data.loader_backend": ("torch", "dali"),
    "synth.compression": PARQUET_CODECS,
    "model.arch": ("dlrm", "melu"),
    "model.interaction": ("dot",),
    "model.embedding_backend": ("auto", "reference", "triton", "fbgemm", "per_table"),
    "model.interaction_backend": ("auto", "reference", "triton"),
    "model.pooling": ("sum", "mean"),
    "optim.dense": ("adam", "sgd", "adagrad"),
    "optim.sparse": ("sgd", "rowwise_adagrad", "adam"),
    "train.loss": ("auto", "bce", "mse"),
    "train.mode": ("dlrm", "meta"),
    "tasks.split": ("random", "time"),
    "meta.adapt": ("top_mlp", "head", "head_and_embedding_shift"),
    "meta.engine": ("batched", "vmap", "loop"),
    "parallel.mode": ("single", "hybrid"),
    "parallel.sharding": ("auto", "table_wise", "row_wise", "column_wise", "data_parallel"),
    "parallel.data": ("global", "sharded"),
    "parallel.backend": ("auto", "nccl", "gloo"),
}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads a TOML config and applies ``section.key=value`` overrides.

    Raises:
        ConfigError: on a missing file, TOML syntax error, unknown key or bad value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p}: {e}") from None
    for item in overrides:
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Builds a :class:`Config` from nested dicts, checking every key and type."""
    cfg = Config()
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(f"unknown config section [{section}]{_suggest(section, sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section [{section}] must be a table, got {values!r}")
        target = getattr(cfg, section)
        fields = {f.name: f for f in dataclasses.fields(target)}
        hints = typing.get_type_hints(type(target))
        for key, value in values.items():
            if key not in fields:
                raise ConfigError(f"unknown config key {section}.{key}{_suggest(key, fields, section + '.')}")
            setattr(target, key, _coerce(f"{section}.{key}", value, hints[key]))
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"config key {dotted} must be one of {', '.join(allowed)}; got {value!r}"
                              f"{_suggest(value, allowed)}")
    return cfg


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


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {dotted!r} must look like section.key")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string: model.embedding_backend=triton
    return parts[0], parts[1], value


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key {key} must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"config key {key} has unsupported type {hint}")


def _suggest(name: str, valid: Any, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else f" (valid: {', '.join(sorted(valid))})"
