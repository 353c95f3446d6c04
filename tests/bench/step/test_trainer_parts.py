"""``recaccel-bench train`` builds its ``recaccel`` candidates with the trainer's own
builders: a config the trainer refuses is refused for the candidate, with the same line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recaccel.bench.step.candidates import BASELINE, Combination, recaccel_candidates
from recaccel.bench.step.data import load_preset
from recaccel.bench.step.parts import trainer_parts
from recaccel.config.rules import check_rules
from recaccel.errors import ConfigError
from recaccel.models.factory import build_model
from recaccel.train.loop.trainer import build_parallel

CPU = torch.device("cpu")


def _with(cfg, section: str, **fields):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)})


def _refusal(build) -> str:
    with pytest.raises(ConfigError) as refused:
        build()
    return str(refused.value)


def test_a_straggler_policy_in_one_process_is_refused_with_the_trainers_line(tiny):
    preset = load_preset(str(tiny), CPU)
    cfg = _with(preset.cfg, "parallel", straggler="rebalance")
    model = build_model(cfg.model, cfg.optim, preset.schema, CPU)
    line = _refusal(lambda: trainer_parts(cfg, model, CPU))
    assert line == _refusal(lambda: build_parallel(cfg, CPU))
    assert "parallel.straggler=rebalance" in line


def test_a_rule_between_sections_is_refused_before_anything_is_built(tiny):
    preset = load_preset(str(tiny), CPU)
    cfg = _with(_with(preset.cfg, "parallel", mode="hybrid"), "train", micro_batches=2)
    model = build_model(cfg.model, cfg.optim, preset.schema, CPU)
    assert _refusal(lambda: trainer_parts(cfg, model, CPU)) == _refusal(lambda: check_rules(cfg))


def test_every_combination_refused_by_the_trainer_is_skipped_with_its_line(tiny):
    preset = load_preset(str(tiny), CPU)
    cfg = _with(preset.cfg, "parallel", data="dynamic")
    combinations = [BASELINE, Combination("sync", 2)]
    built, skipped = recaccel_candidates(cfg, preset.schema, CPU, "recaccel", combinations)
    assert built == []
    line = _refusal(lambda: build_parallel(cfg, CPU))
    assert skipped == dict.fromkeys(combinations, line)


def test_an_accepted_config_gets_the_trainers_layout_and_an_optimizer_over_the_objective(tiny):
    preset = load_preset(str(tiny), CPU)
    model = build_model(preset.cfg.model, preset.cfg.optim, preset.schema, CPU)
    parts = trainer_parts(preset.cfg, model, CPU)
    assert type(parts.layout) is type(build_parallel(preset.cfg, CPU))
    optimized = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
    assert optimized and optimized <= {id(p) for p in parts.objective.module.parameters()}
