"""A meta step (inner loop included) issues no collective operation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from recaccel.config import MetaConfig
from recaccel.meta import MetaLearner
from tests.helpers.meta_batches import make_dlrm, make_task_batch

_COLLECTIVES = [
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
]
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


class _OpLog(TorchDispatchMode):
    """Records the namespace and name of every ATen/c10d op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(f"{func.namespace}::{func.__name__}")
        return func(*args, **(kwargs or {}))

    def collectives(self) -> list[str]:
        return [op for op in self.ops if op.split("::")[0] in _COLLECTIVE_NAMESPACES]


@pytest.fixture
def counted(monkeypatch):
    calls: list[str] = []
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, wrapper)
    return calls


def test_detectors_see_a_collective(one_rank_group, counted):
    log = _OpLog()
    with log:
        dist.all_reduce(torch.ones(3))
    assert counted == ["all_reduce"]
    assert log.collectives()


@pytest.mark.parametrize("first_order", [True, False])
def test_meta_step_issues_no_collective(one_rank_group, counted, first_order):
    cfg = MetaConfig(
        inner_steps=2, inner_lr=0.1, first_order=first_order, meta_sgd=True, adapt="head_and_embedding_shift"
    )
    learner = MetaLearner(make_dlrm(dtype=torch.float32), cfg, loss="bce")
    tb = make_task_batch(4, 5, 6)
    log = _OpLog()
    with log:
        loss, _ = learner.step_loss(tb)
        loss.backward()
        learner.adapt_and_predict(tb)
    assert len(log.ops) > 50  # the mode saw the step's ops
    assert log.collectives() == []
    assert counted == []
