"""The sanity pass before training: the evaluation data and the host cache, checked at step 0.

A run reads ``data.test`` (and each ``meta.eval_states`` path) only when it evaluates,
after training; mis-mapped, empty or out-of-range evaluation data, or an evaluation batch
too large for the device cache of host tables, would fail there, with no metrics. Before
the first training step (fresh or resumed), :func:`sanity_pass`:

1. opens each evaluation source with the reader evaluation uses (the evaluator
   objective's, through ``data.schema``) and reads its first batch (one row group, or a
   few for a large ``data.eval_batch_size``): its columns, types and bad values are
   checked as evaluation will check them; its schema must be the model's (the one
   ``data.train`` gave: the same sparse fields in the same order, no table larger than
   the model's, the same dense columns and label); every id of the batch must be below
   its table's cardinality; a source without a row is refused;
2. sizes the device cache of host tables for the first batches (a few training batches
   and the evaluation batches; :mod:`recaccel.ops.embedding.cache.sizing`);
3. runs each first batch through the evaluation (eval mode, no gradient), one process
   only: a sharded (hybrid) model's forward is a collective, the data checks run on
   every rank alike.

Every failure is one line (:class:`~recaccel.errors.DataError` naming the file and
column, or :class:`~recaccel.errors.ConfigError` naming the key). The pass leaves no
trace: the random generators, the model's modes, the caches' residency and counters are
as before (the training reader is not touched), so a run gives the same results with or
without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from recaccel.errors import DataError
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.readers.protocol import Reader
from recaccel.ops.embedding import PackedEmbeddingBag
from recaccel.ops.embedding.cache.sizing import PackNeed, pack_rows, plan_cache, window_needs
from recaccel.sparse import Batch, SparseFeatures, TaskBatch

if TYPE_CHECKING:
    from recaccel.config import Config
    from recaccel.train.loop.parallel import Parallelism
    from recaccel.train.model.objectives import Objective

logger = logging.getLogger(__name__)

_ENABLED = True  # tests turn the pass off to compare a run with and without it
_TRAIN_SAMPLE = 2  # training batches measured beyond one window


class TrainerView(Protocol):
    """What the pass reads of the trainer (``recaccel.train.loop.trainer.Trainer`` has it;
    named by its shape so the trainer's module and this one do not import each other)."""

    cfg: Config
    device: torch.device
    parallel: Parallelism
    schema: FeatureSchema
    objective: Objective
    evaluator: Objective
    module: nn.Module  # the objective's module as the parallelism wrapped it


def sanity_pass(trainer: TrainerView) -> None:
    """Checks the evaluation data and sizes the host cache before the first step (module docstring).

    Raises:
        DataError: a source that cannot be read, has no row, another schema than the
            model's or an id outside the model's table.
        ConfigError: a host cache capped by ``model.cache_rows`` below one window's rows.
    """
    if not _ENABLED:
        return
    firsts = [
        (path, first_batch(trainer.evaluator, path, f"config key {key}", trainer.schema))
        for key, path in sources(trainer)
    ]
    size_host_caches(trainer, [batch for _, batch in firsts])
    if trainer.parallel.world_size > 1:
        return
    with leaves_no_trace(trainer.objective.module):
        for path, batch in firsts:
            evaluate_one(trainer, batch, path)


def sources(trainer: TrainerView) -> list[tuple[str, str]]:
    """(config key, path) of every source the run evaluates at its end."""
    cfg = trainer.cfg
    found = [("data.test", cfg.data.test)]
    for i, spec in enumerate(cfg.meta.eval_states):  # "name=path", as MetaConfig checked
        found.append((f"meta.eval_states[{i}]", spec.partition("=")[2]))
    return found


def first_batch(objective: Objective, path: str, key: str, model: FeatureSchema) -> Batch | TaskBatch:
    """The first evaluation batch of ``path`` through the objective's own reader, checked
    against the model's schema; ``key`` says where the path came from in the messages
    (``config key data.test``, ``the data scored``).

    Raises:
        DataError: as :func:`sanity_pass` says.
    """
    reader = objective.reader(path, train=False, rank=0, world_size=1)
    batch = _first(reader)
    if batch is None:
        raise DataError(f"no evaluation row could be read ({key})", path=path)
    check_ids(model, sparse_of(batch), path, key)  # first: a bad id names its value
    check_schema(model, reader_schema(reader), path, key)
    return batch


def reader_schema(reader: Reader) -> FeatureSchema:
    """The schema a reader decodes with (the batch and task readers keep it as ``schema``)."""
    return reader.schema  # type: ignore[attr-defined]


def _first(reader: Reader) -> Any:
    """The reader's first batch (None without one); its read-ahead is stopped."""
    batches = iter(reader)
    try:
        return next(batches, None)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def sparse_of(batch: Batch | TaskBatch) -> SparseFeatures:
    """Every id of a batch (a task batch's support and query rows together)."""
    return batch.concat_sparse() if isinstance(batch, TaskBatch) else batch.sparse


def check_schema(model: FeatureSchema, data: FeatureSchema, path: str, key: str) -> None:
    """The data's schema must feed the model's tables and layers as ``data.train``'s does.

    Raises:
        DataError: naming the file, the first column that differs and ``key``.
    """
    where = f"({key}; the model was built from data.train)"
    tables = {f.name: f for f in model.sparse}
    for f in data.sparse:
        if f.name not in tables:
            raise DataError(f"sparse column the model has no table for {where}", path=path, column=f.name)
        table = tables[f.name]
        if f.cardinality > table.cardinality:
            raise DataError(
                f"declares {f.cardinality} ids but the model's table has {table.cardinality} {where}",
                path=path,
                column=f.name,
            )
        if f.multi_hot != table.multi_hot:
            shape = "a list of ids" if f.multi_hot else "one id"
            raise DataError(f"holds {shape} per row, unlike data.train {where}", path=path, column=f.name)
    names = [f.name for f in data.sparse]
    missing = [n for n in tables if n not in names]
    if missing:
        raise DataError(f"sparse column is missing {where}", path=path, column=missing[0])
    if names != list(tables):
        raise DataError(
            f"sparse columns are in the order {names}, the model's {list(tables)} {where}", path=path
        )
    if data.dense != model.dense:
        raise DataError(
            f"dense columns are {list(data.dense)}, the model's {list(model.dense)} {where}", path=path
        )
    if (data.label, data.label_kind) != (model.label, model.label_kind):
        raise DataError(
            f"{data.label_kind} labels in column {data.label!r}, the model's are {model.label_kind} "
            f"in {model.label!r} {where}",
            path=path,
        )


def check_ids(model: FeatureSchema, sf: SparseFeatures, path: str, key: str) -> None:
    """Every id of the batch must be a row of its table.

    Raises:
        DataError: naming the file, the column, the first bad id and its row in the batch.
    """
    tables = {f.name: f.cardinality for f in model.sparse}
    for name in (k for k in sf.keys if k in tables):  # other columns: check_schema's
        ids, offsets, _ = sf.field(name)
        bad = torch.nonzero((ids < 0) | (ids >= tables[name])).flatten()
        if bad.numel():
            j = int(bad[0])
            row = int(torch.searchsorted(offsets, j, right=True)) - 1
            raise DataError(
                f"id {int(ids[j])} at row {row} of the first evaluation batch is not a row of the model's table "
                f"(valid ids are 0..{tables[name] - 1}; {key})",
                path=path,
                column=name,
            )


# ------------------------------------------------------------------ host cache


def size_host_caches(trainer: TrainerView, evals: list[Batch | TaskBatch]) -> None:
    """Sizes every device cache of host tables (or shortens the lookahead) for the first
    batches, with one warning; nothing without host tables.

    Raises:
        ConfigError: a cache capped by ``model.cache_rows`` that cannot hold one window.
    """
    embeddings = [m for m in trainer.objective.module.modules() if isinstance(m, PackedEmbeddingBag)]
    hosts = [(e, i, pack) for e in embeddings for i, pack in e.cached_packs().items()]
    if not hosts:
        return
    model_cfg = trainer.cfg.model
    window = model_cfg.cache_lookahead + 1
    train = training_sample(trainer, window + _TRAIN_SAMPLE)
    needs = []
    for emb, index, pack in hosts:
        rows_train = [pack_rows(emb.plan, sparse_of(b), {index})[index] for b in train]
        rows_eval = [pack_rows(emb.plan, sparse_of(b), {index})[index] for b in evals]
        tables = tuple(t.name for t in pack.layout.tables)
        per_window = {w: window_needs(rows_train, rows_eval, w) for w in range(2, window + 1)}
        needs.append(PackNeed(tables, pack.layout.num_rows, pack.capacity, per_window))
    plan = plan_cache(needs, window, model_cfg.cache_rows, model_cfg.cache_fraction)
    if plan.warning is None:
        return
    logger.warning(plan.warning)
    for (_, _, pack), capacity in zip(hosts, plan.capacities):
        pack.resize(capacity, plan.window)
    if plan.window != window:
        set_lookahead(trainer, plan.window - 1)


def training_sample(trainer: TrainerView, count: int) -> list[Batch | TaskBatch]:
    """The first ``count`` training-sized batches of ``data.train`` in file order (a
    reader of its own: the run's training reader and its shuffle are not touched)."""
    cfg = trainer.cfg
    if cfg.train.mode == "meta":
        reader = trainer.objective.reader(cfg.data.train, train=False, rank=0, world_size=1)
    else:
        from recaccel.io.readers.rows import BatchReader

        data = dataclasses.replace(cfg.data, eval_batch_size=cfg.data.batch_size)
        reader = BatchReader.from_config(cfg.data.train, data, train=False)
    batches = iter(reader)
    try:
        return [b for _, b in zip(range(count), batches)]
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def set_lookahead(trainer: TrainerView, lookahead: int) -> None:
    """Runs with ``model.cache_lookahead = lookahead``: the pipeline prepares that many
    batches minus one ahead (the caches' window was set with their size); the config
    records it."""
    trainer.cfg.model.cache_lookahead = lookahead
    for objective in {id(o): o for o in (trainer.objective, trainer.evaluator)}.values():
        objective.batches_ahead = lookahead - 1


# ------------------------------------------------------------------ one batch


def evaluate_one(trainer: TrainerView, batch: Batch | TaskBatch, path: str) -> None:
    """One evaluation batch through the run's evaluation (its metrics are dropped: one
    batch may hold one class only, whose AUC is undefined)."""
    trainer.module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.evaluator.evaluate([batch.to(trainer.device)], gather=trainer.parallel.gather, source=path)


@contextlib.contextmanager
def leaves_no_trace(model: torch.nn.Module) -> Iterator[None]:
    """Restores what an evaluation may change: the random generators, every submodule's
    train/eval mode, and each host cache (emptied, as at the start of a process: results
    do not depend on what is resident; its counters as they were)."""
    rng = _rng_states()
    modes = [(m, m.training) for m in model.modules()]
    packs = [
        p for m in model.modules() if isinstance(m, PackedEmbeddingBag) for p in m.cached_packs().values()
    ]
    counters = [dataclasses.replace(p.counters) for p in packs]
    try:
        yield
    finally:
        for pack, saved in zip(packs, counters):
            pack.resize(pack.capacity, pack.window.window)
            pack.counters = saved
        for m, training in modes:
            m.training = training
        _set_rng_states(rng)


def _rng_states() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "numpy": np.random.get_state(),
        "random": random.getstate(),
    }


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])
    np.random.set_state(states["numpy"])
    random.setstate(states["random"])
