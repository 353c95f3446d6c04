"""Fixtures shared by the checkpoint tests: fsync events, a one-process gloo group, a hybrid run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recaccel.cli import train_main
from tests.helpers.checkpoints import STEPS
from tests.helpers.dlrm_run import overrides, set_args
from tests.helpers.gloo_ranks import gloo_group_of_one


@pytest.fixture
def events(monkeypatch) -> list[tuple]:
    """Records ("fsync", path) and ("replace", src, dst) in call order (both still run)."""
    log: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        log.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    def recording_replace(src, dst, **kwargs):
        log.append(("replace", Path(src).resolve(), Path(dst).resolve()))
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    return log


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group for the whole module: hybrid runs in this process."""
    pytest.importorskip("torchrec", exc_type=ImportError)
    with gloo_group_of_one():
        yield


@pytest.fixture(scope="module")
def hybrid_run(group, tiny_data, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("hybrid") / "run"
    extra = [
        "parallel.mode=hybrid",
        "optim.sparse=rowwise_adagrad",
        'parallel.table_sharding=["C4=data_parallel"]',
        f"train.steps={STEPS}",
    ]
    assert train_main(set_args(overrides(tiny_data, out, *extra))) == 0
    return out
