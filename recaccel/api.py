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


def evaluate(
    cfg: Config,
    path: str | None = None,
    *,
    checkpoint: int | None = None,
    predictions: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluates a checkpoint of ``cfg.train.out_dir`` (default: the newest) on ``path``
    (default data.test), in this process; the run directory is only read.

    A hybrid run's checkpoint (a ``step-*.dcp`` folder) is read whole, its tables
    assembled from their shards, and scored without launching its ranks again.

    Args:
        cfg: the run's config.
        path: the data to score (default ``data.test``).
        checkpoint: the step of the checkpoint to score (default: the newest).
        predictions: a Parquet file to write one prediction per evaluation row to, beside
            its label, weight and (meta runs) task key (:mod:`recaccel.train.predictions`).

    Returns:
        The metrics, with ``checkpoint_step`` (and ``predictions``, the file written).

    Raises:
        RecaccelError: no checkpoint (or none at ``checkpoint``: the message lists the
            steps there are), or one that cannot be read.
    """
    from recaccel.preflight import preflight
    from recaccel.train.eval_checkpoint import evaluate_run

    preflight(cfg, training=False, test_path=path)
    return evaluate_run(cfg, path, checkpoint=checkpoint, predictions=predictions)


def _toml_str(value: str | Path) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
