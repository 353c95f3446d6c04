"""Straggler mitigation of hybrid runs (``parallel.straggler``), as AntDT's controller.

In synchronous training every step waits for the slowest rank. Each rank measures its
step's compute (step time less the time inside collectives, :class:`~recaccel.train.
distributed.monitor.Monitor`) and the rows (or tasks) it trained; the next step's
agreement allreduce carries every rank's pair in its own slots (a sum with one non-zero
term per slot: exact, so every rank holds the same numbers). A policy
on each rank turns them, every ``parallel.straggler_every`` steps, into each rank's share
of the global batch, the same decision everywhere:

- ``rebalance`` (dedicated clusters, AntDT-DD; ``parallel.data = "global"``): shares move
  halfway towards each rank's measured speed (rows per second of compute). With a
  fixed per-step cost the fixed point is equal compute times, the best a synchronous
  step can do. Every rank reads the global batch and trains its share's slice of it.
- ``backup`` (shared clusters, AntDT-ND; ``parallel.data = "dynamic"``): only a rank whose
  time per row exceeds ``parallel.backup_factor`` times the others' median is cut to
  its speed share; the others split the rest equally (transient noise moves nothing). It
  is restored once within ``sqrt(backup_factor)`` of the others.
  Each rank cuts its next batches at its new size from the shards it is handed, so a
  slowed rank asks for fewer shards and the faster ranks take the ones it would have
  read. A rank whose queue ran dry joins the remaining steps with an empty batch, so
  the epoch ends when every rank is done: no shard is left half-read.

The update does not depend on the split: rank r's loss is its mean times ``n_r / N``
(its share of the global normaliser, agreed every step), so the summed gradient is that
of the global mean, whatever the ``n_r`` (:func:`weighted_gradient_check` in the tests).

Both need unequal local batches through TorchRec, which table-wise and column-wise
sharding carry and row-wise (equal all-gather blocks) does not.

One class per policy behind one interface (:class:`~recaccel.train.distributed.straggler.
policy.StragglerPolicy`): ``off`` (:class:`Off`), ``rebalance`` (:class:`Rebalance`),
``backup`` (:class:`Backup`); :func:`build_policy` picks one from the config.

::

    compute_s  [0.10, 0.10, 0.20, 0.10]   rows [64, 64, 64, 64]
    rebalance  rate = rows / compute -> shares 0.25 -> (0.25 + 0.286) / 2 ...
    backup     rank 2: 2.0x the median time per row > 1.5 -> share 0.143, others 0.286
"""

from __future__ import annotations

from recaccel.config import Config
from recaccel.config.rules import check_rule
from recaccel.errors import ConfigError
from recaccel.train.distributed.straggler.backup import Backup
from recaccel.train.distributed.straggler.policy import Off, StragglerPolicy
from recaccel.train.distributed.straggler.rebalance import Rebalance
from recaccel.train.distributed.straggler.split import MIN_SHARE, SharedSplit, split_units

_DATA = {"rebalance": "global", "backup": "dynamic"}


def build_policy(cfg: Config, rank: int, world_size: int) -> StragglerPolicy:
    """The policy of ``parallel.straggler`` for this rank."""
    p = cfg.parallel
    if p.straggler == "rebalance":
        return Rebalance(world_size, p.straggler_every, rank)
    if p.straggler == "backup":
        return Backup(world_size, p.straggler_every, p.backup_factor, rank)
    return Off(rank, world_size)


def check_straggler(cfg: Config) -> None:
    """Refuses straggler settings this hybrid run cannot act on (before any work).

    Raises:
        ConfigError: a policy with the wrong ``parallel.data``, a pipeline or no drop_last.
    """
    policy = cfg.parallel.straggler
    if policy == "off":
        return
    if cfg.parallel.data != _DATA[policy]:
        raise ConfigError(
            f"parallel.straggler={policy} needs parallel.data={_DATA[policy]}, got {cfg.parallel.data}"
        )
    check_rule(cfg, "straggler_policy_needs_no_pipeline")  # a config changed after it was loaded


def check_plan_kinds(policy: str, kinds: dict[str, str]) -> None:
    """Refuses row-wise tables under a straggler policy (their backward needs equal batches).

    Args:
        policy: ``parallel.straggler``.
        kinds: each sharded table's kind in TorchRec's plan.

    Raises:
        ConfigError: a row-wise table (naming it).
    """
    if policy == "off":
        return
    bad = sorted(t for t, kind in kinds.items() if kind not in ("table_wise", "column_wise"))
    if bad:
        raise ConfigError(
            f"parallel.straggler={policy} gives ranks unequal batches, which table {bad[0]!r} "
            f"({kinds[bad[0]]}) cannot take; set parallel.sharding=table_wise or column_wise"
        )


__all__ = [
    "MIN_SHARE",
    "Backup",
    "Off",
    "Rebalance",
    "SharedSplit",
    "StragglerPolicy",
    "build_policy",
    "check_plan_kinds",
    "check_straggler",
    "split_units",
]
