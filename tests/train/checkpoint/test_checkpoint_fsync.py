"""Checkpoints are durable before they become the newest: data fsynced, then renamed into
place, then the directory fsynced (a power loss leaves the old checkpoint or the new one,
never a torn file under the new name)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from recaccel.train.checkpoint.state import TrainState, save_checkpoint

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="names fsynced files through /proc"
)


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters())


def _index(log: list[tuple], event: tuple) -> int:
    assert event in log, (event, log)
    return log.index(event)


def test_pt_checkpoint_is_fsynced_then_renamed_then_its_directory_fsynced(tmp_path, events):
    model, optimizer = _model_and_optimizer()
    path = save_checkpoint(tmp_path, model, optimizer, TrainState(step=3)).resolve()
    tmp = path.with_suffix(".tmp")
    renamed = _index(events, ("replace", tmp, path))
    assert _index(events, ("fsync", tmp)) < renamed
    assert ("fsync", path.parent) in events[renamed:]  # also fsynced before: its digest file's rename
    assert torch.load(path, weights_only=True)["step"] == 3


def test_dcp_checkpoint_files_and_folder_are_fsynced_before_the_rename(tmp_path, events, one_rank_group):
    from recaccel.train.distributed.dist_checkpoint import INFO_FILE, save_sharded

    model, optimizer = _model_and_optimizer()
    parallel = SimpleNamespace(
        rank=0, world_size=1, is_main=True, dmp=None, replicated=None, replicated_optimizer=None
    )
    final = save_sharded(tmp_path, parallel, model, optimizer, TrainState(step=4)).resolve()
    renames = [e for e in events if e[0] == "replace" and e[2] == final]
    assert len(renames) == 1
    partial = renames[0][1]
    renamed = events.index(renames[0])
    names = sorted(p.name for p in final.iterdir())
    assert INFO_FILE in names and ".metadata" in names and any(n.endswith(".distcp") for n in names)
    for name in names:  # every file, under its final name in the folder being renamed
        assert _index(events, ("fsync", partial / name)) < renamed, name
    assert _index(events, ("fsync", partial)) < renamed
    assert _index(events, ("fsync", final.parent)) > renamed
