"""The Python API: train (in this process or as N ranks) and evaluate from a config, with
recaccel's model or one's own."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recaccel.config import Config, load_config, path_fields, section_types
from recaccel.config.files import absolute_value, toml_value
from recaccel.train.run.runlog import CONFIG_FILE

if TYPE_CHECKING:  # torch is imported when a run starts, not with recaccel
    from recaccel.train.model.user_model import ModelSource


def train(
    cfg: Config, *, resume: bool = False, overwrite: bool = False, model: ModelSource | None = None
) -> dict[str, Any]:
    """Trains and evaluates the model ``cfg`` describes; returns the final metrics.

    Writes ``cfg.train.out_dir``: config.toml (its paths absolute, so the run resumes
    from any working directory), log.jsonl, checkpoints/, metrics.json.

    Args:
        cfg: the run's config.
        resume: continue the run in ``cfg.train.out_dir`` from its newest checkpoint
            (from step 0 when it stopped before its first checkpoint).
        overwrite: replace a run already in ``cfg.train.out_dir`` (the files recaccel
            wrote there are deleted first, others are left, see
            :func:`~recaccel.train.run.runlog.clear_run`); without it such a run directory is
            refused.
        model: one's own model instead of the one ``[model]`` describes: an ``nn.Module``
            with ``embed(sparse) -> [B, F, D]``, ``head(dense, pooled) -> logits [B]`` and
            ``prepare_sparse(sparse)``, or a callable ``(schema, device) -> such a module``
            (see docs/own_model.md and :mod:`recaccel.train.model.user_model`). Pass the same
            model again to :func:`resume` and :func:`evaluate`. A config naming its model
            by ``model.class_path`` needs none: the run's config.toml names it again.

    Raises:
        RunDirInUseError: another process trains in ``cfg.train.out_dir`` (it holds
            ``RUN/.lock``, see :mod:`recaccel.train.run.run_lock`), whatever ``overwrite`` says.
        RecaccelError: a run directory that already holds a run (neither ``resume`` nor
            ``overwrite``), bad config or input, a model without the methods a run calls
            (or a ``model.class_path`` that does not import or take its ``init_args``),
            a checkpoint that cannot be resumed.
    """
    from recaccel.preflight import preflight
    from recaccel.train.loop.trainer import Trainer
    from recaccel.train.model.user_model import model_source
    from recaccel.train.run.run_lock import for_training

    model = model_source(cfg, model)  # model.class_path imported and its init_args checked now
    preflight(cfg)  # bad fields, missing inputs, an unusable run dir: refused before any work
    with for_training(Path(cfg.train.out_dir)):  # before anything there is read or written
        trainer = Trainer(
            absolute_paths(cfg),
            resume=resume,
            overwrite=overwrite,
            fresh_if_no_checkpoint=resume,
            model=model,
        )
        return trainer.fit()


def launch(
    cfg: Config, *, nproc: int, max_restarts: int = 0, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Trains ``cfg`` as ``nproc`` processes (ranks) on this host, under torchrun's
    elastic agent; returns the final metrics, as :func:`train` does (read back from
    metrics.json, which rank 0 writes: a non-finite number is None).

    Everything is checked before a rank starts: the config (``parallel.mode`` must be
    ``hybrid``) and its inputs, the run directory (held locked for every rank and
    restart; one already holding a run is refused unless ``resume`` or ``overwrite``)
    and, on resume, that the newest checkpoint moves to ``nproc`` ranks. Each rank
    prints as this process does (the console lines ``-v`` or ``-q`` chose, see
    :func:`~recaccel.train.run.console.show_console`).
    Several hosts: run ``torchrun ... -m recaccel.cli`` on each
    (:mod:`recaccel.train.distributed.launch`).

    Args:
        cfg: the run's config.
        nproc: number of ranks (one per device).
        max_restarts: after a rank fails, restart every rank up to this many times,
            each attempt resuming from the newest checkpoint (0: the run fails).
        resume: continue the run in ``cfg.train.out_dir`` (:func:`run_config` reads its
            config), possibly on another number of ranks.
        overwrite: replace a run already in ``cfg.train.out_dir``.

    Raises:
        ConfigError: ``nproc`` < 1, ``max_restarts`` < 0, a config not in hybrid mode,
            both ``resume`` and ``overwrite``, or a call from inside a torchrun rank.
        RecaccelError: bad input, a run directory in use or already holding a run, a
            checkpoint that cannot move to ``nproc`` ranks, and
            :class:`~recaccel.train.distributed.launch.RankFailedError` when a rank
            failed (its message: the first failure, in one line).
        Preempted: a signal stopped the ranks after their checkpoint was written (a
            ``KeyboardInterrupt``; ``exit_status`` 143 for SIGTERM, 130 for SIGINT).
    """
    from recaccel.train.distributed.launcher import launch_ranks

    return launch_ranks(
        absolute_paths(cfg), nproc=nproc, max_restarts=max_restarts, resume=resume, overwrite=overwrite
    )


def check_launch(cfg: Config, nproc: int) -> None:
    """What :func:`launch` checks first: ``nproc`` >= 1 and a config in hybrid mode.

    Raises:
        ConfigError: one line naming what is wrong and the ``--set`` that fixes it.
    """
    from recaccel.train.distributed.launch import check_launch as check

    check(cfg, nproc)


def resume(
    run_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), *, model: ModelSource | None = None
) -> dict[str, Any]:
    """Continues a run from its newest checkpoint (config from ``run_dir/config.toml``);
    a run stopped before its first checkpoint starts again from step 0.

    Args:
        run_dir: the run directory.
        overrides: ``section.key=value`` items applied to the run's config.
        model: the run's own model, as given to :func:`train` (None: the one the run's
            config names, ``model.class_path`` or recaccel's).
    """
    return train(run_config(run_dir, overrides), resume=True, model=model)


def run_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of the run in ``run_dir``: its config.toml with ``overrides`` applied and
    ``train.out_dir`` set to ``run_dir``.

    The run wrote its paths resolved (absolute since path resolution was added); a
    relative one, from an older run or a config built in Python, is read as it was meant
    then: relative to the working directory, not to the run directory.

    Raises:
        ConfigError: no readable config.toml in ``run_dir``, or a bad override.
    """
    path = Path(run_dir) / CONFIG_FILE
    sets = [*overrides, f"train.out_dir={toml_value(str(run_dir))}"]
    return load_config(path, sets, paths_relative_to_file=False)


def evaluate(
    cfg: Config,
    path: str | None = None,
    *,
    model: ModelSource | None = None,
    checkpoint: int | None = None,
    predictions: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluates a checkpoint of ``cfg.train.out_dir`` (default: the newest) on ``path``
    (default data.test), in this process; the run directory is only read.

    A hybrid run's checkpoint (a ``step-*.dcp`` folder) is read whole, its tables
    assembled from their shards, and scored without launching its ranks again.

    Args:
        cfg: the run's config (:func:`run_config` reads it from the run directory).
        path: the data to score (default ``data.test``).
        model: the run's own model, as given to :func:`train` (None: recaccel's model).
        checkpoint: the step of the checkpoint to score (default: the newest).
        predictions: a Parquet file to write one prediction per evaluation row to, beside
            its label, weight and (meta runs) task key (:mod:`recaccel.train.evaluation.predictions`).

    Returns:
        The metrics, with ``checkpoint_step`` (and ``predictions``, the file written).

    Raises:
        RecaccelError: no checkpoint (or none at ``checkpoint``: the message lists the
            steps there are), or one that cannot be read.
    """
    from recaccel.preflight import preflight
    from recaccel.train.evaluation.from_checkpoint import evaluate_run
    from recaccel.train.model.user_model import model_source

    model = model_source(cfg, model)  # the run's model.class_path, as training built it
    preflight(cfg, training=False, test_path=path)
    return evaluate_run(cfg, path, checkpoint=checkpoint, predictions=predictions, model=model)


def absolute_paths(cfg: Config) -> Config:
    """``cfg`` with every relative path value (:func:`~recaccel.config.path_fields`)
    made absolute against the working directory (what it meant)."""
    changed, cwd = {}, Path.cwd()
    for name, cls in section_types().items():
        section = getattr(cfg, name)
        updates = {
            key: absolute_value(getattr(section, key), cwd, named) for key, named in path_fields(cls).items()
        }
        updates = {k: v for k, v in updates.items() if v != getattr(section, k)}
        if updates:
            changed[name] = dataclasses.replace(section, **updates)
    return dataclasses.replace(cfg, **changed) if changed else cfg
