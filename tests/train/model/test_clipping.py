"""Gradient clipping of the dense parameters (``optim.grad_clip_norm``): the update is
torch's ``clip_grad_norm_`` then the step, in every step the trainer takes; 0 leaves
training bit-identical to a plain optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from recaccel.config import load_config
from recaccel.train.checkpoint.state import list_checkpoints
from recaccel.train.loop.trainer import Trainer
from recaccel.train.model.optim import build_dense_optimizer
from tests.helpers.gloo_ranks import gloo_group_of_one
from tests.helpers.resume import small_sets

pytestmark = pytest.mark.numeric


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))


def _set_grads(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 3.0


@pytest.mark.parametrize("dense", ["sgd", "adam", "adagrad"])
def test_step_is_torchs_clip_then_step(dense):
    cfg = load_config(None, [f"optim.dense={dense}", "optim.lr=0.1", "optim.grad_clip_norm=0.5"]).optim
    ours, theirs = _model(), _model()
    unclipped = copy.deepcopy(theirs)
    opt = build_dense_optimizer(ours, cfg)
    ref = build_dense_optimizer(theirs, load_config(None, [f"optim.dense={dense}", "optim.lr=0.1"]).optim)
    plain = build_dense_optimizer(
        unclipped, load_config(None, [f"optim.dense={dense}", "optim.lr=0.1"]).optim
    )
    for seed in range(3):
        for m in (ours, theirs, unclipped):
            _set_grads(m, seed)
        norm = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), 0.5)
        assert norm > 0.5  # the clip binds
        opt.step()
        ref.step()
        plain.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b)
        grads = torch.cat([p.grad.flatten() for p in ours.parameters()])
        assert float(grads.norm()) == pytest.approx(0.5, rel=1e-5)  # clipped in place, as torch does
    assert not all(torch.equal(a, b) for a, b in zip(ours.parameters(), unclipped.parameters()))


def test_a_parameter_without_gradient_is_left_out():
    cfg = load_config(None, ["optim.dense=sgd", "optim.lr=1.0", "optim.grad_clip_norm=1.0"]).optim
    model = _model()
    opt = build_dense_optimizer(model, cfg)
    first, *_ = model.parameters()
    for p in model.parameters():
        p.grad = None if p is first else torch.full_like(p, 10.0)
    before = first.detach().clone()
    opt.step()
    assert torch.equal(first, before)
    assert float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()) == (
        pytest.approx(1.0, rel=1e-5)
    )


def _norms_at_step(trainer: Trainer) -> list[float]:
    """The dense gradients' norm as each optimizer step applies them (after the clip)."""
    seen = []

    def record(opt, args, kwargs):
        grads = [p.grad.flatten() for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.cat(grads).norm()))

    trainer.optimizer.register_step_pre_hook(record)  # runs after the clip, registered first
    return seen


@pytest.mark.parametrize("extra", [[], ["train.pipeline=semi_sync"], ["train.micro_batches=2"]])
def test_trainer_clips_every_step(small_data, tmp_path, extra):  # noqa: F811
    cfg = load_config(
        None,
        small_sets(small_data, tmp_path / "run", "optim.grad_clip_norm=0.001", "train.steps=4", *extra)[1::2],
    )
    trainer = Trainer(cfg)
    seen = _norms_at_step(trainer)
    trainer.fit()
    assert seen == pytest.approx([0.001] * 4, rel=1e-4)


def test_hybrid_clips_the_summed_gradients(small_data, tmp_path):  # noqa: F811
    pytest.importorskip("torchrec", exc_type=ImportError)
    sets = [
        "optim.grad_clip_norm=0.001",
        "train.steps=3",
        "parallel.mode=hybrid",
        "optim.sparse=rowwise_adagrad",
    ]
    with gloo_group_of_one():
        trainer = Trainer(load_config(None, small_sets(small_data, tmp_path / "run", *sets)[1::2]))
        seen = _norms_at_step(trainer)
        trainer.fit()
    assert seen == pytest.approx([0.001] * 3, rel=1e-4)


def test_zero_is_bit_identical_to_a_plain_optimizer(small_data, tmp_path):  # noqa: F811
    """grad_clip_norm = 0: the same run as one whose optimizer is torch's, untouched."""
    finals = []
    for name in ("ours", "plain"):
        cfg = load_config(
            None, small_sets(small_data, tmp_path / name, "optim.grad_clip_norm=0", "train.steps=6")[1::2]
        )
        trainer = Trainer(cfg)
        if name == "plain":
            params = [p for p in trainer.objective.module.parameters() if p.requires_grad]
            trainer.optimizer = torch.optim.Adam(params, lr=cfg.optim.lr, eps=cfg.optim.eps)
        trainer.fit()
        finals.append(torch.load(list_checkpoints(tmp_path / name)[-1], weights_only=True))
    ours, plain = finals
    assert ours["model"].keys() == plain["model"].keys()
    for key, value in ours["model"].items():
        assert torch.equal(value, plain["model"][key]), key
    assert ours["step"] == plain["step"] == 6
