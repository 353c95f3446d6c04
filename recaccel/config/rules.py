"""The rules that span config sections, in one table.

A section checks its own fields (and the rules among them) when it is built; a rule that
reads keys of two sections (``parallel.mode = "hybrid"`` with ``train.micro_batches = 2``)
can only be checked on the whole :class:`~recaccel.config.Config`. Each such rule is a row
of :data:`RULES`: its name, the keys it reads and a function that returns the one-line
refusal naming those keys and values, or None. :func:`check_rules` runs the table when a
config is loaded (:func:`recaccel.config.load_config`) and again before a run starts
(:func:`recaccel.preflight.preflight`, which ``recaccel.train`` and ``recaccel.launch``
call), so a broken rule fails in one line before any process or rank starts. Code that
meets a rule late (a config changed after it was built) calls :func:`check_rule` by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recaccel.config.sections import Config
from recaccel.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """One rule across config sections.

    Attributes:
        name: what the rule is called (tests and :func:`check_rule` use it).
        keys: the config keys it reads, as ``section.key``.
        broken: returns the refusal (one line naming the keys and values) for a config that
            breaks the rule, else None.
    """

    name: str
    keys: tuple[str, ...]
    broken: Callable[[Config], str | None]

    def check(self, cfg: Config) -> None:
        """Raises ConfigError with the rule's message when ``cfg`` breaks it."""
        message = self.broken(cfg)
        if message is not None:
            raise ConfigError(message)


def _hybrid(cfg: Config) -> bool:
    return cfg.parallel.mode == "hybrid"


def _hybrid_needs_drop_last(cfg: Config) -> str | None:
    if _hybrid(cfg) and not cfg.data.drop_last:
        return "parallel.mode=hybrid needs data.drop_last = true (every rank trains on equal batches)"
    return None


def _hybrid_runs_one_batch_per_step(cfg: Config) -> str | None:
    n = cfg.train.micro_batches
    if _hybrid(cfg) and n > 1:
        return f"train.micro_batches={n} runs parallel.mode=single; use train.micro_batches=1"
    return None


def _hybrid_runs_eager_dense_arches(cfg: Config) -> str | None:
    if _hybrid(cfg) and (cfg.train.cuda_graphs or cfg.train.compile):
        key = "train.cuda_graphs" if cfg.train.cuda_graphs else "train.compile"
        return f"{key}=true runs parallel.mode=single; set it to false in hybrid mode"
    return None


def _hybrid_keeps_no_best_checkpoint(cfg: Config) -> str | None:
    if _hybrid(cfg) and cfg.train.best_metric:
        return (
            f"config key train.best_metric={cfg.train.best_metric} (best.pt, early stopping) runs "
            "parallel.mode=single"
        )
    return None


def _hybrid_places_no_table_on_host(cfg: Config) -> str | None:
    m = cfg.model
    on_host = m.embedding_placement == "host" or any(e.endswith("=host") for e in m.table_placement)
    if _hybrid(cfg) and on_host:
        return (
            "model.embedding_placement=host (or a table_placement of host) runs parallel.mode=single: hybrid "
            "mode shards the tables through TorchRec, which places them itself"
        )
    return None


def _hybrid_shards_fp32_tables(cfg: Config) -> str | None:
    # A model of one's own (model.class_path) brings its own tables.
    dtype = cfg.model.embedding_dtype
    if _hybrid(cfg) and dtype != "fp32" and not cfg.model.class_path:
        return f"TorchRec tables (parallel.mode=hybrid) run model.embedding_dtype=fp32 only, got {dtype}"
    return None


def _hybrid_pipelines_dlrm_only(cfg: Config) -> str | None:
    mode = cfg.train.pipeline
    if _hybrid(cfg) and cfg.train.mode == "meta" and mode != "off":
        return (
            f"train.pipeline={mode} in parallel.mode=hybrid runs DLRM row batches; "
            "meta-learning runs train.pipeline=off"
        )
    return None


def _hybrid_runs_no_overlap(cfg: Config) -> str | None:
    # The overlap step drives one process's packed embedding; TorchRec shards them in hybrid mode.
    if _hybrid(cfg) and cfg.train.pipeline == "overlap":
        return "train.pipeline=overlap runs parallel.mode=single; use train.pipeline=sync"
    return None


def _step_graph(cfg: Config) -> bool:
    return cfg.train.cuda_graphs and cfg.train.cuda_graph_scope == "step"


_REPLAYS = "train.cuda_graph_scope=step (a replay repeats the host's scalars of its capture)"


def _step_graph_replays_fixed_rates(cfg: Config) -> str | None:
    """A captured step replays the scalars it was captured with: a dense SGD's or Adagrad's
    rate (the embedding's and dense Adam's live in device tensors) and sparse Adam's bias
    corrections."""
    o = cfg.optim
    if not _step_graph(cfg):
        return None
    scheduled = o.schedule != "constant" or o.warmup_steps > 0
    if scheduled and o.dense != "adam":
        return f"{_REPLAYS} replays optim.dense={o.dense} at one rate (torch reads it on the host): with optim.schedule={o.schedule} and optim.warmup_steps={o.warmup_steps} use optim.dense=adam"  # noqa: E501
    if o.sparse == "adam":
        return f"{_REPLAYS} does not replay optim.sparse=adam (its bias corrections change every step); use rowwise_adagrad or sgd"  # noqa: E501
    return None


def _step_graph_captures_device_fp32_triton_tables(cfg: Config) -> str | None:
    """A captured step replays 16-bit rows' rounding seed of its capture, cannot fill a host
    table's cache, and captures the packed Triton embedding."""
    m = cfg.model
    if not _step_graph(cfg):
        return None
    if m.embedding_dtype != "fp32":
        return f"{_REPLAYS} does not replay model.embedding_dtype={m.embedding_dtype} (its rounding seed changes every step); use fp32"  # noqa: E501
    if m.embedding_placement == "host" or any(e.endswith("=host") for e in m.table_placement):
        return "train.cuda_graph_scope=step does not capture host-placed tables (model.embedding_placement, model.table_placement: their cache is filled on the host); place them on the device"  # noqa: E501
    if m.embedding_backend not in ("auto", "triton"):
        return f"train.cuda_graph_scope=step captures the packed Triton embedding; model.embedding_backend={m.embedding_backend} (use auto or triton)"  # noqa: E501
    return None


def _dynamic_data_reads_rows(cfg: Config) -> str | None:
    if cfg.parallel.data == "dynamic" and cfg.train.mode != "dlrm":
        return "parallel.data=dynamic reads rows (train.mode=dlrm); use parallel.data=global"
    return None


def _straggler_policy_needs_no_pipeline(cfg: Config) -> str | None:
    policy = cfg.parallel.straggler
    if policy != "off" and cfg.train.pipeline != "off":
        return (
            f"parallel.straggler={policy} splits batches step by step: set train.pipeline=off "
            f"(got {cfg.train.pipeline})"
        )
    return None


def _monitor_runs_hybrid(cfg: Config) -> str | None:
    if not _hybrid(cfg) and cfg.monitor.every > 0:
        return f"monitor.every={cfg.monitor.every} runs parallel.mode=hybrid; set it to 0"
    return None


def _slow_rank_runs_hybrid(cfg: Config) -> str | None:
    if not _hybrid(cfg) and cfg.fault.slow_rank >= 0:
        return f"fault.slow_rank={cfg.fault.slow_rank} runs parallel.mode=hybrid; set it to -1"
    return None


# Checked in this order: the first broken rule is the one reported.
RULES: tuple[Rule, ...] = (
    Rule("hybrid_needs_drop_last", ("parallel.mode", "data.drop_last"), _hybrid_needs_drop_last),
    Rule(
        "hybrid_runs_one_batch_per_step",
        ("parallel.mode", "train.micro_batches"),
        _hybrid_runs_one_batch_per_step,
    ),
    Rule(
        "hybrid_runs_eager_dense_arches",
        ("parallel.mode", "train.cuda_graphs", "train.compile"),
        _hybrid_runs_eager_dense_arches,
    ),
    Rule(
        "hybrid_keeps_no_best_checkpoint",
        ("parallel.mode", "train.best_metric"),
        _hybrid_keeps_no_best_checkpoint,
    ),
    Rule(
        "hybrid_places_no_table_on_host",
        ("parallel.mode", "model.embedding_placement", "model.table_placement"),
        _hybrid_places_no_table_on_host,
    ),
    Rule(
        "hybrid_shards_fp32_tables",
        ("parallel.mode", "model.embedding_dtype", "model.class_path"),
        _hybrid_shards_fp32_tables,
    ),
    Rule(
        "hybrid_pipelines_dlrm_only",
        ("parallel.mode", "train.mode", "train.pipeline"),
        _hybrid_pipelines_dlrm_only,
    ),
    Rule("hybrid_runs_no_overlap", ("parallel.mode", "train.pipeline"), _hybrid_runs_no_overlap),
    Rule(
        "step_graph_replays_fixed_rates",
        (
            "train.cuda_graphs",
            "train.cuda_graph_scope",
            "optim.schedule",
            "optim.warmup_steps",
            "optim.dense",
            "optim.sparse",
        ),  # fmt: skip
        _step_graph_replays_fixed_rates,
    ),
    Rule(
        "step_graph_captures_device_fp32_triton_tables",
        (
            "train.cuda_graphs",
            "train.cuda_graph_scope",
            "model.embedding_dtype",
            "model.embedding_placement",
            "model.table_placement",
            "model.embedding_backend",
        ),  # fmt: skip
        _step_graph_captures_device_fp32_triton_tables,
    ),
    Rule("dynamic_data_reads_rows", ("parallel.data", "train.mode"), _dynamic_data_reads_rows),
    Rule(
        "straggler_policy_needs_no_pipeline",
        ("parallel.straggler", "train.pipeline"),
        _straggler_policy_needs_no_pipeline,
    ),
    Rule("monitor_runs_hybrid", ("monitor.every", "parallel.mode"), _monitor_runs_hybrid),
    Rule("slow_rank_runs_hybrid", ("fault.slow_rank", "parallel.mode"), _slow_rank_runs_hybrid),
)


def check_rules(cfg: Config) -> None:
    """Checks ``cfg`` against every rule of :data:`RULES`, in order.

    Raises:
        ConfigError: the first broken rule's one-line message.
    """
    for rule in RULES:
        rule.check(cfg)


def check_rule(cfg: Config, name: str) -> None:
    """Checks ``cfg`` against the rule called ``name`` only (for code that meets it late).

    Raises:
        ConfigError: ``cfg`` breaks the rule.
        KeyError: no rule has that name (a programming error, not bad input).
    """
    _BY_NAME[name].check(cfg)


_BY_NAME = {rule.name: rule for rule in RULES}
