"""Fault injection (``[fault]``, for tests and demos only), kept out of the training loop.

- ``fault.kill_rank``: :class:`KillRank`, a step observer, ends its process with
  ``os._exit`` right after step ``fault.kill_rank_at_step``.
- ``fault.slow_rank``: :class:`SlowRank` sleeps ``slow_factor - 1`` times the rank's own
  compute once per step, at the point the monitor (:mod:`recaccel.train.distributed.monitor`)
  marks that compute done, so the delay overlaps the other ranks' compute as a slower
  device's would.
"""

from __future__ import annotations

import os
import time

from recaccel.config import FaultConfig
from recaccel.train.loop.observers import Note, StepDone, StepObserver


class KillRank(StepObserver):
    """Ends this process abruptly after step ``fault.kill_rank_at_step`` on
    ``fault.kill_rank``, in the first attempt only: ranks that torchrun's agent restarted
    (``--max-restarts``) resume before that step and must get past it.

    Args:
        fault: ``[fault]``.
        rank: this rank.
    """

    name = "fault"

    def __init__(self, fault: FaultConfig, rank: int) -> None:
        self.step = fault.kill_rank_at_step if fault.kill_rank_at_step > 0 and rank == fault.kill_rank else 0

    def after_step(self, step: int, done: StepDone) -> tuple[Note, ...]:
        from recaccel.train.distributed.launch import restart_count

        if self.step and step == self.step and restart_count() == 0:
            os._exit(17)  # abrupt by design: no clean-up, no checkpoint, peers see a dead rank
        return ()


class SlowRank:
    """``fault.slow_rank``'s delay: called with the rank's compute of a step, sleeps
    ``slow_factor - 1`` times it (on other ranks: nothing) and returns the seconds slept.

    Args:
        fault: ``[fault]``.
        rank: this rank.
    """

    def __init__(self, fault: FaultConfig, rank: int) -> None:
        self.extra = fault.slow_factor - 1.0 if fault.slow_rank == rank else 0.0

    def __call__(self, compute_s: float) -> float:
        if self.extra <= 0:
            return 0.0
        slept = self.extra * max(compute_s, 0.0)
        time.sleep(slept)
        return slept
