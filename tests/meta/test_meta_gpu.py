"""Meta-learning on CUDA: the meta step's loss and meta-gradients equal the CPU float64 result.

Every engine (batched bmm, torch.func vmap, per-task loop), first and second order,
Meta-SGD; float64 on the GPU must agree to rounding, float32 to float32 tolerance
(TF32 is off for matmuls by default in PyTorch, and is forced off here).
"""

from __future__ import annotations

import copy

import pytest
import torch

from recaccel.config import MetaConfig
from recaccel.meta import MetaLearner
from recaccel.ops.tf32 import tf32
from tests.helpers.meta_batches import make_dlrm, make_task_batch

pytestmark = pytest.mark.gpu


@pytest.fixture
def no_tf32():
    # Through recaccel's switch: a legacy-flag read raises once the process has set torch's
    # newer fp32_precision strings to a state the legacy flags cannot express.
    with tf32(False):
        yield


def _learner(engine: str, first_order: bool, meta_sgd: bool) -> MetaLearner:
    cfg = MetaConfig(
        inner_steps=2,
        inner_lr=0.3,
        first_order=first_order,
        meta_sgd=meta_sgd,
        adapt="head_and_embedding_shift",
    )
    return MetaLearner(make_dlrm(), cfg, loss="bce", engine=engine)


def _loss_and_grads(learner: MetaLearner, tb) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    learner.zero_grad(set_to_none=True)
    loss = learner.step_loss(tb)[0]
    loss.backward()
    grads = {n: p.grad.detach().cpu().double() for n, p in learner.named_parameters() if p.grad is not None}
    return loss.detach().cpu().double(), grads


def _on(learner: MetaLearner, tb, device: str, dtype: torch.dtype):
    moved = copy.deepcopy(learner).to(device=device, dtype=dtype)
    batch = tb.to(device)
    for part in (batch.support, batch.query):
        part.dense = part.dense.to(dtype)
        part.labels = part.labels.to(dtype)
    batch.support_mask = batch.support_mask.to(dtype)
    batch.query_mask = batch.query_mask.to(dtype)
    return moved, batch


@pytest.mark.parametrize("engine", ["batched", "vmap", "loop"])
@pytest.mark.parametrize("first_order,meta_sgd", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_meta_step_on_cuda_equals_cpu_float64(engine, first_order, meta_sgd, dtype, rtol, no_tf32):
    tb = make_task_batch(8, 6, 5, loss="bce", seed=4)
    learner = _learner(engine, first_order, meta_sgd)
    ref_loss, ref_grads = _loss_and_grads(*_on(learner, tb, "cpu", torch.float64))
    loss, grads = _loss_and_grads(*_on(learner, tb, "cuda", dtype))
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=rtol)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=rtol, atol=rtol, msg=name)
