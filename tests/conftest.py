"""Shared fixtures. Real datasets live in ../shared/data and are never copied here."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

# Triton kernels run on CPU only under the interpreter, and whether a kernel is
# interpreted is fixed when triton first imports: set it before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


TEST_SEED = 0


def seed_global_generators(seed: int) -> None:
    """Seeds torch's (CPU and every CUDA device), numpy's and Python's global generators."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def seeded_global_generators():
    """Every test starts from the same global generator state, so a model it builds or a
    tensor it draws holds the same values whichever tests ran before it."""
    seed_global_generators(TEST_SEED)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    """Module and session fixtures are built by whichever test first needs them, before that
    test's seeding: seed them too, by name (two such fixtures draw different values)."""
    if fixturedef.scope != "function":
        seed_global_generators(zlib.crc32(fixturedef.argname.encode()))


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


@pytest.fixture
def one_rank_group():
    """A real one-process gloo group, for code that issues (or must not issue) collectives."""
    from tests.helpers.gloo_ranks import gloo_group_of_one

    with gloo_group_of_one():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Data shared by the training tests, one dataset per test module that asks. Imported inside
# the fixtures, so that loading this file imports no recaccel module.


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """The synthetic dataset of ``tests.helpers.dlrm_run.TINY`` (6000 training rows)."""
    from recaccel.config import load_config
    from recaccel.io.convert.synth import generate_synthetic
    from tests.helpers.dlrm_run import TINY

    root = tmp_path_factory.mktemp("synth")
    cfg = load_config(None, [*TINY, f'synth.out_dir="{root}"'])
    generate_synthetic(cfg.synth)
    return root


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """The synthetic dataset of ``tests.helpers.resume.SMALL`` (1800 training rows)."""
    from recaccel.config import load_config
    from recaccel.io.convert.synth import generate_synthetic
    from tests.helpers.resume import SMALL

    root = tmp_path_factory.mktemp("synth")
    generate_synthetic(load_config(None, [*SMALL, f'synth.out_dir="{root}"']).synth)
    return root


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> tuple[Path, Path]:
    """Task-grouped ratings: 48 training users, 16 test users."""
    from tests.helpers.meta_run import write_ratings

    root = tmp_path_factory.mktemp("tasks")
    return write_ratings(root / "train", range(0, 48), 0), write_ratings(root / "test", range(48, 64), 1)
