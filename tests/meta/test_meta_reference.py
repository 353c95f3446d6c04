"""Second-order meta-gradients against central finite differences, in float64.

test_meta_gradients.py compares every engine with a plain per-task autograd loop (an
independently written reference: ``torch.autograd.grad`` per task and inner step,
``create_graph=True`` for second order, no recaccel.meta code). That reference shares
autograd's second-order machinery with the engines; here the full MAML and Meta-SGD
meta-gradient (2 inner steps) is checked without it: central differences of the
post-adaptation query loss, for head, embedding and inner-rate parameters, on the
default (batched) engine (the other engines match it through the autograd reference).
The first-order gradient must differ from it, so the check can tell the two apart.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.config import MetaConfig
from recaccel.meta import MetaLearner
from tests.helpers.meta_batches import make_dlrm, make_task_batch

pytestmark = pytest.mark.numeric


H = 1e-6  # float64: truncation ~H^2, rounding ~1e-16/H, both far below the tolerance


def _learner(engine: str, meta_sgd: bool, first_order: bool) -> MetaLearner:
    cfg = MetaConfig(
        inner_steps=2,
        inner_lr=0.3,
        first_order=first_order,
        meta_sgd=meta_sgd,
        adapt="head_and_embedding_shift",
    )
    learner = MetaLearner(make_dlrm(), cfg, loss="bce", engine=engine)
    gen = torch.Generator().manual_seed(3)
    for rate in learner.inner_lrs.values():  # distinct rates per entry
        rate.data.copy_(torch.rand(rate.shape, generator=gen, dtype=rate.dtype) * 0.4 + 0.05)
    return learner


def _grads(learner: MetaLearner, tb) -> dict[str, torch.Tensor]:
    learner.zero_grad(set_to_none=True)
    learner.step_loss(tb)[0].backward()
    out = {n: p.grad.clone() for n, p in learner.named_parameters() if p.grad is not None}
    learner.zero_grad(set_to_none=True)
    return out


def _coordinates(grad: torch.Tensor, count: int = 2) -> list[tuple[int, ...]]:
    """The largest-gradient entries of a parameter (touched embedding rows among them)."""
    flat = grad.abs().flatten()
    top = torch.topk(flat, min(count, flat.numel())).indices
    return [tuple(int(i) for i in torch.unravel_index(j, grad.shape)) for j in top]


@pytest.mark.parametrize("meta_sgd", [False, True])
def test_second_order_meta_gradient_matches_finite_differences(meta_sgd):
    tb = make_task_batch(4, 5, 6, loss="bce", seed=9)
    learner = _learner("batched", meta_sgd, first_order=False)
    grads = _grads(learner, tb)
    params = dict(learner.named_parameters())
    assert any(n.startswith("model.sparse_arch.") for n in grads)
    assert not meta_sgd or any(n.startswith("inner_lrs.") for n in grads)
    checked = 0
    for name, grad in grads.items():
        p = params[name]
        for idx in _coordinates(grad):
            with torch.no_grad():
                orig = p[idx].item()
                p[idx] = orig + H
                plus = learner.step_loss(tb)[0].item()
                p[idx] = orig - H
                minus = learner.step_loss(tb)[0].item()
                p[idx] = orig
            fd = (plus - minus) / (2 * H)
            assert grad[idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-8), f"{name}{list(idx)}"
            checked += 1
    assert checked >= 2 * len(grads) - 2  # a bias of one entry has one coordinate


def test_first_order_gradient_differs_from_the_true_meta_gradient():
    tb = make_task_batch(4, 5, 6, loss="bce", seed=9)
    second = _grads(_learner("batched", True, first_order=False), tb)
    first = _grads(_learner("batched", True, first_order=True), tb)
    head = [n for n in second if n.startswith("model.over_arch.")]
    assert head and max(float((second[n] - first[n]).abs().max()) for n in head) > 1e-4
