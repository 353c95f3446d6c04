"""The table of config rules that span sections (recaccel/config/rules.py): every rule has a
config that breaks it and one that keeps it, each rule reads the keys it names, and a broken
rule is refused in one line when the config is loaded, before any run or rank starts."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from recaccel import api
from recaccel.cli import train_main
from recaccel.config import RULES, check_rule, check_rules, config_from_dict, load_config, section_types
from recaccel.config.files import parse_override
from recaccel.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Case:
    """A rule's breaking and keeping configs: ``base`` plus ``broken`` or ``kept`` overrides
    (the latter two set only keys the rule names)."""

    rule: str
    base: tuple[str, ...]
    broken: tuple[str, ...]
    kept: tuple[str, ...]
    message: str  # the refusal, a regular expression matched from its start

    def __str__(self) -> str:
        return f"{self.rule}:{'+'.join(self.broken)}"


HYBRID = "parallel.mode=hybrid"
CASES = (
    Case(
        "hybrid_needs_drop_last",
        (HYBRID,),
        ("data.drop_last=false",),
        ("data.drop_last=true",),
        r"parallel.mode=hybrid needs data.drop_last = true \(every rank trains on equal batches\)$",
    ),
    Case(
        "hybrid_runs_one_batch_per_step",
        ("train.micro_batches=2",),
        (HYBRID,),
        ("parallel.mode=single",),
        r"train.micro_batches=2 runs parallel.mode=single; use train.micro_batches=1$",
    ),
    Case(
        "hybrid_runs_eager_dense_arches",
        (HYBRID,),
        ("train.compile=true",),
        ("train.compile=false",),
        r"train.compile=true runs parallel.mode=single; set it to false in hybrid mode$",
    ),
    Case(
        "hybrid_runs_eager_dense_arches",
        ("train.cuda_graphs=true",),
        (HYBRID,),
        ("parallel.mode=single",),
        r"train.cuda_graphs=true runs parallel.mode=single",
    ),
    Case(
        "hybrid_keeps_no_best_checkpoint",
        ("train.best_metric=auc", "train.eval_every=10"),
        (HYBRID,),
        ("parallel.mode=single",),
        r"config key train.best_metric=auc \(best.pt, early stopping\) runs parallel.mode=single$",
    ),
    Case(
        "hybrid_places_no_table_on_host",
        (HYBRID,),
        ("model.embedding_placement=host",),
        ("model.embedding_placement=device",),
        r"model.embedding_placement=host \(or a table_placement of host\) runs parallel.mode=single",
    ),
    Case(
        "hybrid_places_no_table_on_host",
        (HYBRID,),
        ('model.table_placement=["t1=host"]',),
        ('model.table_placement=["t1=device"]',),
        r"model.embedding_placement=host \(or a table_placement of host\)",
    ),
    Case(
        "hybrid_shards_fp32_tables",
        (HYBRID,),
        ("model.embedding_dtype=bf16",),
        ("model.embedding_dtype=fp32",),
        r"TorchRec tables \(parallel.mode=hybrid\) run model.embedding_dtype=fp32 only, got bf16$",
    ),
    Case(
        "hybrid_shards_fp32_tables",
        (HYBRID, "model.embedding_dtype=fp16"),
        (),
        ('model.class_path="my_models.tower:Tower"',),  # one's own model brings its own tables
        r"TorchRec tables \(parallel.mode=hybrid\) run model.embedding_dtype=fp32 only, got fp16$",
    ),
    Case(
        "hybrid_pipelines_dlrm_only",
        (HYBRID, "train.mode=meta"),
        ("train.pipeline=sync",),
        ("train.pipeline=off",),
        r"train.pipeline=sync in parallel.mode=hybrid runs DLRM row batches; meta-learning runs "
        r"train.pipeline=off$",
    ),
    Case(
        "hybrid_runs_no_overlap",
        (HYBRID,),
        ("train.pipeline=overlap",),
        ("train.pipeline=sync",),
        r"train.pipeline=overlap runs parallel.mode=single; use train.pipeline=sync$",
    ),
    Case(
        "dynamic_data_reads_rows",
        (HYBRID, "parallel.data=dynamic"),
        ("train.mode=meta",),
        ("train.mode=dlrm",),
        r"parallel.data=dynamic reads rows \(train.mode=dlrm\); use parallel.data=global$",
    ),
    Case(
        "step_graph_replays_fixed_rates",
        ("train.cuda_graphs=true", 'train.cuda_graph_scope="step"', "optim.warmup_steps=100"),
        ('optim.dense="sgd"',),
        ('optim.dense="adam"',),
        r"train.cuda_graph_scope=step \(a replay repeats the host's scalars of its capture\) replays "
        r"optim.dense=sgd at one rate \(torch reads it on the host\): with optim.schedule=constant and "
        r"optim.warmup_steps=100 use optim.dense=adam$",
    ),
    Case(
        "step_graph_replays_fixed_rates",
        ("train.cuda_graphs=true",),
        ('train.cuda_graph_scope="step"', 'optim.sparse="adam"'),
        ('train.cuda_graph_scope="head"', 'optim.sparse="adam"'),
        r"train.cuda_graph_scope=step .* does not replay optim.sparse=adam \(its bias corrections",
    ),
    Case(
        "step_graph_captures_device_fp32_triton_tables",
        ("train.cuda_graphs=true",),
        ('train.cuda_graph_scope="step"', 'model.embedding_dtype="bf16"'),
        ('train.cuda_graph_scope="step"', 'model.embedding_dtype="fp32"'),
        r"train.cuda_graph_scope=step .* does not replay model.embedding_dtype=bf16 \(its rounding seed",
    ),
    Case(
        "step_graph_captures_device_fp32_triton_tables",
        ("train.cuda_graphs=true", 'train.cuda_graph_scope="step"'),
        ('model.table_placement=["t1=host"]',),
        ("model.table_placement=[]",),
        r"train.cuda_graph_scope=step does not capture host-placed tables \(model.embedding_placement",
    ),
    Case(
        "straggler_policy_needs_no_pipeline",
        (HYBRID, "parallel.straggler=rebalance"),
        ("train.pipeline=sync",),
        ("train.pipeline=off",),
        r"parallel.straggler=rebalance splits batches step by step: set train.pipeline=off \(got sync\)$",
    ),
    Case(
        "monitor_runs_hybrid",
        ("monitor.every=5",),
        ("parallel.mode=single",),
        (HYBRID,),
        r"monitor.every=5 runs parallel.mode=hybrid; set it to 0$",
    ),
    Case(
        "slow_rank_runs_hybrid",
        ("fault.slow_rank=1",),
        ("parallel.mode=single",),
        (HYBRID,),
        r"fault.slow_rank=1 runs parallel.mode=hybrid; set it to -1$",
    ),
)
RULE_NAMES = [rule.name for rule in RULES]


def _unchecked(overrides: tuple[str, ...]):
    """The config of ``overrides``, every section checked but no rule across sections."""
    raw: dict = {}
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw)


def _broken_rules(overrides: tuple[str, ...]) -> list[str]:
    cfg = _unchecked(overrides)
    return [rule.name for rule in RULES if rule.broken(cfg) is not None]


def test_every_rule_has_a_breaking_and_a_keeping_case():
    assert len(set(RULE_NAMES)) == len(RULE_NAMES), "two rules share a name"
    assert sorted({case.rule for case in CASES}) == sorted(RULE_NAMES)


def test_every_rule_reads_keys_of_two_sections_that_exist():
    fields = {
        f"{section}.{f.name}" for section, cls in section_types().items() for f in dataclasses.fields(cls)
    }
    for rule in RULES:
        assert set(rule.keys) <= fields, f"{rule.name} names keys no section has"
        assert len({key.split(".")[0] for key in rule.keys}) >= 2, f"{rule.name} spans one section"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_case_changes_only_keys_its_rule_names(case):
    keys = set(next(rule.keys for rule in RULES if rule.name == case.rule))
    for item in case.broken + case.kept:
        section, key, _ = parse_override(item)
        assert f"{section}.{key}" in keys, f"{item} is not a key {case.rule} reads"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_breaking_config_breaks_its_rule_alone_and_is_refused_on_load(case):
    overrides = case.base + case.broken
    assert _broken_rules(overrides) == [case.rule]
    with pytest.raises(ConfigError, match="^" + case.message) as refused:
        load_config(None, list(overrides))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_keeping_config_loads(case):
    overrides = case.base + case.kept
    assert _broken_rules(overrides) == []
    load_config(None, list(overrides))


def test_check_rule_checks_the_named_rule_only():
    cfg = _unchecked((HYBRID, "train.micro_batches=2", "monitor.every=0"))
    check_rule(cfg, "monitor_runs_hybrid")
    with pytest.raises(ConfigError, match="^train.micro_batches=2 runs parallel.mode=single"):
        check_rule(cfg, "hybrid_runs_one_batch_per_step")
    with pytest.raises(KeyError):
        check_rule(cfg, "no_such_rule")


def test_the_first_broken_rule_in_table_order_is_reported():
    cfg = _unchecked((HYBRID, "data.drop_last=false", "train.micro_batches=2"))
    with pytest.raises(ConfigError, match="^parallel.mode=hybrid needs data.drop_last"):
        check_rules(cfg)


def test_train_refuses_a_config_changed_after_loading_before_touching_the_run_dir(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [HYBRID, f"train.out_dir={run}", "train.progress=false"])
    cfg.train.micro_batches = 2  # no section check sees this; the rules before the run do
    with pytest.raises(ConfigError, match="^train.micro_batches=2 runs parallel.mode=single"):
        api.train(cfg)
    assert not run.exists()


def test_cli_refuses_micro_batches_in_hybrid_mode_in_one_line_before_launching_ranks(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [
        "--nproc",
        "2",
        "--set",
        HYBRID,
        "--set",
        "train.micro_batches=2",
        "--set",
        f"train.out_dir={run}",
    ]
    started = time.perf_counter()
    assert train_main(argv) == 2
    took = time.perf_counter() - started
    err = capsys.readouterr().err.strip()
    assert err == (
        "recaccel-train: error: train.micro_batches=2 runs parallel.mode=single; use train.micro_batches=1"
    )
    assert not run.exists(), "a rank started: the run directory was made"
    assert took < 10, f"refused after {took:.1f} s: ranks were launched"


def test_rule_messages_name_the_keys_they_read():
    # Every message names, as section.key, at least one key of each section its rule reads.
    for case in CASES:
        rule = next(r for r in RULES if r.name == case.rule)
        message = rule.broken(_unchecked(case.base + case.broken))
        named = set(re.findall(r"\b(\w+)\.\w+", message))
        assert {key.split(".")[0] for key in rule.keys} <= named, message
