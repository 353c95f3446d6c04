"""Checks before a run starts: what the config alone cannot say.

A :class:`~recaccel.config.Config` checks its own fields; whether its input paths hold
data, its run directory can be one, and its backends can run on this machine are
questions for the file system and the machine, asked here once, before any work, so a
mistake is one line naming the key instead of a failure after training.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from recaccel.config import Config, ModelConfig, UnreadableFilesPolicy, check_rules, section_types, show_value
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.cache.manifest import is_cache, load_manifest
from recaccel.io.format.dataset import list_files
from recaccel.ops.backend import fbgemm_installed, triton_interpret_enabled


def preflight(
    cfg: Config,
    *,
    training: bool = True,
    test_path: str | Path | None = None,
    config_files: Sequence[str | Path] = (),
) -> None:
    """Checks, before a run starts, what the config alone cannot say.

    Every field is checked again (a Config may have been changed after it was built), and,
    when training, the rules across sections; then the inputs: ``data.train`` (its schema
    builds the model, for evaluation too),
    the evaluation data (``test_path``, default ``data.test``) and, when training, each
    ``meta.eval_states`` path must be a Parquet file or a folder holding some;
    ``train.out_dir`` must not be (or lie inside) a file; a ``triton`` backend needs a
    CUDA device or ``TRITON_INTERPRET=1``, and ``fbgemm`` the ``fbgemm_gpu`` package.
    A missing dataset's message names the ``recaccel-data`` command that makes it
    (:func:`make_data_hint`).

    Args:
        cfg: the run's config.
        training: a training run (checks the meta.eval_states paths too).
        test_path: the data an evaluation reads instead of ``data.test``.
        config_files: the config files ``cfg`` was read from, for the hint's command line.

    Raises:
        ConfigError: naming the key (``section.key=value``) and what is wrong.
    """
    cfg.__post_init__()
    for name in section_types():
        getattr(cfg, name).__post_init__()
    if training:
        check_rules(cfg)  # the rules across sections (recaccel.config.rules), before any work

    def check(what: str, path: str | Path) -> None:
        _check_dataset(what, path, lambda: make_data_hint(cfg, path, config_files), cfg.data.unreadable_files)

    check(f"config key data.train={show_value(cfg.data.train)}", cfg.data.train)
    if test_path is None:
        check(f"config key data.test={show_value(cfg.data.test)}", cfg.data.test)
    else:
        check(f"evaluation data {show_value(str(test_path))}", test_path)
    if training:
        for i, entry in enumerate(cfg.meta.eval_states):
            check(f"config key meta.eval_states[{i}]={show_value(entry)}", entry.partition("=")[2])
    _check_run_dir(cfg.train.out_dir)
    _check_backends(cfg.model, cfg.train.device)


def _check_dataset(
    what: str,
    path: str | Path,
    hint: Callable[[], str | None] = lambda: None,
    unreadable: UnreadableFilesPolicy = "warn",
) -> None:
    """A dataset path must be what the readers open (:func:`~recaccel.io.format.dataset.list_files`):
    a readable regular file, a folder with ``*.parquet`` files in it (its unreadable ones
    as ``unreadable`` says), or a pre-decoded cache folder whose manifest checks out;
    ``hint()`` says how to make a missing one."""
    if not Path(path).exists() and not Path(path).is_symlink():
        command = hint()
        raise ConfigError(f"{what} does not exist" + (f"; make it with: {command}" if command else ""))
    if is_cache(path):
        try:
            load_manifest(path)
        except DataError as e:
            raise ConfigError(f"{what}: {e}") from None
        return
    try:
        list_files(path, unreadable)
    except DataError as e:
        if Path(path).is_dir() and not any(Path(path).glob("*.parquet")):
            raise ConfigError(f"{what} is a folder without *.parquet files") from None
        raise ConfigError(f"{what}: {e}") from None


def make_data_hint(cfg: Config, path: str | Path, config_files: Sequence[str | Path] = ()) -> str | None:
    """The ``recaccel-data`` command that makes the dataset ``path`` by the conventions of
    ``configs/`` (None when no convention matches, or for data read through ``[data.schema]``,
    which is one's own).

    - ``synth.out_dir`` or its ``train``/``test``: ``recaccel-data synth`` with the config files;
    - a MeLU state folder (``warm_state``, ``user_cold_state``, ...): ``recaccel-data melu``;
    - ``OUT/train`` or ``OUT/test``: ``recaccel-data movielens`` in meta mode (users are
      tasks), ``recaccel-data criteo`` otherwise.
    """
    from recaccel.io.convert.melu import STATES, VALID_STATES

    if getattr(cfg.data, "schema", None) is not None:
        return None
    target = Path(os.path.abspath(path))
    synth = Path(os.path.abspath(cfg.synth.out_dir))
    if target in (synth, synth / "train", synth / "test"):
        return " ".join(["recaccel-data synth", *(f"--config {f}" for f in config_files)])
    out = target.parent
    if target.name in STATES + VALID_STATES:
        return f"recaccel-data melu MELU_STATES_DIR {out}"
    if target.name in ("train", "test"):
        if cfg.train.mode == "meta" or cfg.train.eval_tasks:
            return f"recaccel-data movielens ML_100K_DIR {out}"
        return f"recaccel-data criteo CRITEO_TSV {out}"
    return None


def _check_run_dir(out_dir: str) -> None:
    """The run directory, or the nearest of its parents that exists, must be a folder."""
    p = Path(out_dir)
    what = f"config key train.out_dir={show_value(out_dir)}"
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what} is a file, not a run directory")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{what} lies inside {parent}, which is a file")
            return


def _check_backends(model: ModelConfig, device: str) -> None:
    """Triton kernels run on CUDA, or on CPU only under Triton's interpreter; fbgemm needs its package."""
    for key in ("embedding_backend", "interaction_backend"):
        backend = getattr(model, key)
        if backend == "triton" and not triton_interpret_enabled() and not _cuda(device):
            raise ConfigError(f"config key model.{key}=triton needs a CUDA device or TRITON_INTERPRET=1")
        if backend == "fbgemm" and not fbgemm_installed():
            raise ConfigError(f"config key model.{key}=fbgemm needs the fbgemm_gpu package (not installed)")


def _cuda(device: str) -> bool:
    """Whether ``train.device`` resolves to a CUDA device (``auto``: when one is available)."""
    if device != "auto":
        return device.startswith("cuda")
    return torch.cuda.is_available()
