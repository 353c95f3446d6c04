"""The Python API: train and evaluate from a config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recaccel.config import Config, load_config
from recaccel.train.runlog import CONFIG_FILE


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Trains and evaluates the model ``cfg`` describes; returns the final metrics.

    Writes ``cfg.train.out_dir``: config.toml, log.jsonl, checkpoints/, metrics.json.

    Args:
        cfg: the run's config.
        resume: continue the run in ``cfg.train.out_dir`` from its newest checkpoint
            (from step 0 when it stopped before its first checkpoint).
        overwrite: replace a run already in ``cfg.train.out_dir`` (its checkpoints, log
            and metrics are deleted first); without it such a run directory is refused.

    Raises:
        RecaccelError: a run directory that already holds a run (neither ``resume`` nor
            ``overwrite``), bad config or input, a checkpoint that cannot be resumed.
    """
    from recaccel.preflight import preflight
    from recaccel.train.trainer import Trainer

    preflight(cfg)  # bad fields, missing inputs, an unusable run dir: refused before any work
    return Trainer(cfg, resume=resume, overwrite=overwrite, fresh_if_no_checkpoint=resume).fit()


def resume(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Continues a run from its newest checkpoint (config from ``run_dir/config.toml``);
    a run stopped before its first checkpoint starts again from step 0."""
    cfg = load_config(Path(run_dir) / CONFIG_FILE, [*overrides, f"train.out_dir={_toml_str(run_dir)}"])
    return train(cfg, resume=True)


def evaluate(cfg: Config, path: str | None = None) -> dict[str, Any]:
    """Evaluates the newest checkpoint of ``cfg.train.out_dir`` on ``path`` (default
    data.test); the run directory is only read.

    Raises:
        RecaccelError: if the run has no checkpoint or it cannot be read.
    """
    from recaccel.preflight import preflight
    from recaccel.train.trainer import Trainer

    preflight(cfg, training=False, test_path=path)
    trainer = Trainer(cfg, resume=True)  # loads the newest checkpoint, as the parallel layout saved it
    try:
        return trainer.evaluate(path)
    finally:
        trainer.parallel.close()


def _toml_str(value: str | Path) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
