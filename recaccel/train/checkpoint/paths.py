"""Where a run's checkpoints lie: ``step-<step>.pt`` files of single-process runs and
``step-<step>.dcp/`` folders of hybrid runs, under ``run_dir/checkpoints/``.

A ``step-<step>.pt`` file has its SHA-256 beside it in ``step-<step>.pt.sha256``
(:func:`digest_file`, ``sha256sum`` format); a ``.dcp`` folder lists its files' SHA-256s
in its ``recaccel.json``.

Both checkpoint writers (:mod:`recaccel.train.checkpoint.state`,
:mod:`recaccel.train.distributed.dist_checkpoint`) and the resume logic list them here,
so neither writer imports the other.
"""

from __future__ import annotations

import re
from pathlib import Path

from recaccel.train.run.runlog import CHECKPOINT_DIR

INFO_FILE = "recaccel.json"  # in a .dcp folder, written last: the folder is complete
DIGEST_SUFFIX = ".sha256"  # beside a .pt file: its SHA-256, written before the file is renamed into place
_FILE = re.compile(r"step-(\d+)\.pt$")
_FOLDER = re.compile(r"^step-(\d+)\.dcp$")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files (``step-*.pt``) of a run, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [p for p in folder.glob("step-*.pt") if _FILE.search(p.name)]
    return sorted(found, key=lambda p: int(_FILE.search(p.name).group(1)))


def named_step(path: Path) -> int | None:
    """The step a checkpoint's name says (``step-000000010.pt``: 10), or None for another name."""
    found = _FILE.search(Path(path).name) or _FOLDER.match(Path(path).name)
    return int(found.group(1)) if found else None


def digest_file(path: Path) -> Path:
    """The file holding the SHA-256 of the checkpoint file ``path`` (``<name>.sha256``)."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def list_sharded_checkpoints(run_dir: Path) -> list[Path]:
    """Complete sharded checkpoints (``step-*.dcp`` folders) of a run, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [p for p in folder.glob("step-*.dcp") if _FOLDER.match(p.name) and (p / INFO_FILE).is_file()]
    return sorted(found, key=lambda p: int(_FOLDER.match(p.name).group(1)))


def all_checkpoints(run_dir: Path) -> list[Path]:
    """Every checkpoint of a run: its ``step-*.pt`` files and complete ``step-*.dcp`` folders."""
    return list_checkpoints(run_dir) + list_sharded_checkpoints(run_dir)


def newest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a resume of ``run_dir`` reads: its newest ``step-*.pt`` file or complete
    ``step-*.dcp`` folder (the checkpoints folder itself when it has none)."""
    found = all_checkpoints(run_dir)
    if not found:
        return Path(run_dir) / CHECKPOINT_DIR
    return max(found, key=lambda p: int(re.search(r"step-(\d+)", p.name).group(1)))
