"""Fixtures of the meta-learning tests: a small task batch, one intra-op thread per test."""

from __future__ import annotations

import pytest
import torch

from recaccel.sparse import TaskBatch
from tests.helpers.meta_batches import make_task_batch


@pytest.fixture
def task_batch() -> TaskBatch:
    return make_task_batch(4, 5, 6)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny shapes gain nothing from intra-op threads, and on a shared 2-core machine
    # thread contention makes them many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
