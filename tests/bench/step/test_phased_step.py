"""The instrumented step of ``recaccel-bench train``: recaccel's ``off/1/off`` with the
fused sparse update timed on its own trains exactly as the plain step, and the dense
head's FLOP count is the layers' and the interaction's."""

from __future__ import annotations

import copy

import torch
from torch import nn

from recaccel.bench.step.data import device_batches, load_preset, make_dataset
from recaccel.bench.step.phased import (
    PhaseTimer,
    dense_head_tflops,
    head_flops_per_sample,
    recaccel_phased_step,
)
from recaccel.models.factory import build_model
from recaccel.train.model.optim import build_dense_optimizer

CPU = torch.device("cpu")


def _loss(model, batch):
    logits = model(batch).float()
    return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, weight=batch.weights)


def test_the_phased_step_updates_every_weight_as_the_plain_step(tiny, tmp_path):
    preset = load_preset(str(tiny), CPU)
    torch.manual_seed(0)
    plain = build_model(preset.cfg.model, preset.cfg.optim, preset.schema, CPU).train()
    phased = copy.deepcopy(plain)
    data = make_dataset(preset, 2 * preset.batch_size, tmp_path / "data")
    batches = device_batches(data, preset, 2, CPU)
    plain_opt = build_dense_optimizer(plain, preset.cfg.optim)
    phased_opt = build_dense_optimizer(phased, preset.cfg.optim)
    timer = PhaseTimer(CPU)
    step = recaccel_phased_step(phased, phased_opt, "fp32", CPU)
    for batch in batches:
        plain_opt.zero_grad(set_to_none=True)
        _loss(plain, batch).backward()
        plain_opt.step()
        timer.start_step()
        step(batch, timer)
    want, got = plain.state_dict(), phased.state_dict()
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert all(s["sparse_update"] > 0 and s["backward"] > 0 for s in timer.steps)


def test_head_flops_count_the_layers_and_the_pairs(tiny):
    preset = load_preset(str(tiny), CPU)
    model = build_model(preset.cfg.model, preset.cfg.optim, preset.schema, CPU)
    macs = sum(
        m.in_features * m.out_features
        for arch in (model.dense_arch, model.over_arch)
        for m in arch.modules()
        if isinstance(m, nn.Linear)
    )
    f, d = model.interaction_arch.num_sparse, model.interaction_arch.dim
    assert head_flops_per_sample(model) == 6 * (macs + (f + 1) * f // 2 * d)
    phases = {"mlps": 2.0, "interaction": 0.5, "backward": 1.5}
    assert dense_head_tflops(phases, 1e6, 4000) == 1e6 * 4000 / 4e-3 / 1e12
    assert dense_head_tflops({**phases, "backward": "merged"}, 1e6, 4000) is None
    assert dense_head_tflops(phases, None, 4000) is None
