"""A host-placed pack accepts a batch on its own device however the device is spelled."""

from __future__ import annotations

import pytest
import torch

from recaccel.ops.embedding.cache.prepared import same_device


def test_same_device_compares_type_and_index_not_spelling():
    assert same_device("cpu", torch.device("cpu"))
    assert same_device("cpu:0", "cpu")
    assert not same_device("cpu", "meta")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_without_an_index_is_the_current_device():
    current = torch.cuda.current_device()
    assert same_device("cuda", f"cuda:{current}") and same_device(f"cuda:{current}", "cuda")
    assert not same_device("cuda", "cpu")
    if torch.cuda.device_count() > 1:
        assert not same_device("cuda", f"cuda:{(current + 1) % torch.cuda.device_count()}")
