"""What a captured training step needs of a packed embedding: :class:`CapturedUpdates`, a
base of :class:`~recaccel.ops.embedding.module.PackedEmbeddingBag`.

A CUDA graph of a whole training step (:mod:`recaccel.train.loop.step_graph`) replays the
module's kernels but none of its host work. So the module lets the capturing caller: do
the deferred bounds check's host side around each replay (:meth:`checks_by_caller`,
:meth:`raise_landed_checks`, :meth:`queue_replayed_check`), keep the learning rate in device tensors the schedule
refills (:meth:`keep_rates_in_place`), advance the host's update counts
(:meth:`step_counts`), and know when a replayed update would not be the module's own
(:meth:`replay_unsupported`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

from recaccel.ops.embedding.deferred_check import PendingChecks
from recaccel.ops.embedding.packing import PackingPlan
from recaccel.ops.embedding.prepared import PreparedSparse
from recaccel.ops.embedding.rounding import StochasticRounding
from recaccel.sparse import SparseFeatures


class CapturedUpdates:
    """The module's side of a captured training step (no state of its own: it reads the
    module's packs, plan, rounding and pending checks)."""

    plan: PackingPlan
    rounding: StochasticRounding | None
    dtype: str
    _packs: list
    _pending_checks: PendingChecks
    _checks_by_caller: bool

    def _queue_check(self, sf: PreparedSparse) -> None:
        if not self._checks_by_caller:
            self._pending_checks.queue(sf)

    @contextlib.contextmanager
    def checks_by_caller(self) -> Iterator[None]:
        """Within the block, lookups neither read nor queue the deferred bounds check's
        counts: a CUDA graph capture may neither query events nor copy to the host. The
        capturing caller does what each lookup would have done after each replay, with
        :meth:`queue_replayed_check`."""
        before, self._checks_by_caller = self._checks_by_caller, True
        try:
            yield
        finally:
            self._checks_by_caller = before

    def keep_rates_in_place(self) -> None:
        """For a captured step: each pack's learning rate lives in one device tensor that
        :meth:`set_learning_rate` refills, so a replay reads each step's rate. By default a
        change of rate makes a new tensor, so an update keeps the rate of its lookup (a
        semi-sync step looks the next batch up before that step's rate is set)."""
        for pack in self._packs:
            pack.rates_in_place = True

    def step_counts(self) -> list[Tensor]:
        """Each pack's update count (int64 scalar CPU tensors: Adam's ``t``, advanced by
        the host once per update), for a caller that replays updates without their host work."""
        return [pack.step for pack in self._packs]

    def replay_unsupported(self) -> str | None:
        """Why a replayed captured update would not be this module's update, or None: a
        replay repeats the host's scalars of the captured step, and Adam's bias corrections
        and 16-bit rows' rounding seed change every step."""
        if any(layout.optimizer == "adam" for layout in self.plan.packs):
            return (
                "sparse optimizers whose scalars stay the same from step to step, not adam (bias corrections)"
            )
        if self.rounding is not None:
            return f"float32 rows, not {self.dtype} (the rounding seed changes every step)"
        return None

    def raise_landed_checks(self) -> None:
        """Raises the deferred bounds check's error of an earlier batch whose count has
        landed non-zero (no waiting): what every lookup does first, and a captured step
        before its replay, so no step trains after a bad batch's error could be known.
        Nothing inside :meth:`checks_by_caller` (a capture may not query events).

        Raises:
            InvalidIdError: an earlier batch's count landed non-zero.
        """
        if not self._checks_by_caller:
            self._pending_checks.raise_bad(wait=False)

    def queue_replayed_check(self, batch: SparseFeatures, replayed: PreparedSparse) -> None:
        """Queues the deferred bounds check of ``batch``, trained by a replayed captured step:
        a copy of the graph's counter ``replayed.bad_ids`` (which the next replay
        overwrites), under ``batch`` itself, so a bad id's message names this batch's
        feature, id and row.

        Args:
            batch: The batch as the step got it (its static copy is what the graph read;
                checked eagerly for the message only if its count lands non-zero).
            replayed: The preparation the captured step made of that static copy.
        """
        if replayed.bad_ids is not None:
            self._pending_checks.queue_count(batch, replayed.routing, replayed.bad_ids.clone())
