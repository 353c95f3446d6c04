"""Shared fixtures. Real datasets live in ../shared/data and are never copied here."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU only under the interpreter, and whether a kernel is
# interpreted is fixed when triton first imports: set it before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def shared_dataset(name: str, required: str | None = None) -> Path:
    """Folder of a real dataset in ../shared/data, or skip the test with the reason.

    Args:
        name: the dataset's folder.
        required: a file the test needs inside it.
    """
    path = SHARED_DATA / name
    if not (path / required if required else path).exists():
        pytest.skip(f"real dataset {path} is absent (licences forbid copying it into the repository)")
    return path


@pytest.fixture(scope="session")
def shared_data():
    """:func:`shared_dataset`, for tests: ``shared_data("movielens-100k", "u.data")``."""
    return shared_dataset


@contextlib.contextmanager
def gloo_group_of_one():
    """A real one-process gloo group on a free local port, destroyed on exit."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group():
    """A real one-process gloo group, for code that issues (or must not issue) collectives."""
    with gloo_group_of_one():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
