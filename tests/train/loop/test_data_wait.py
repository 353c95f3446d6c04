"""DataWait: time blocked in next() is attributed to start-up and steady state.

A simulated clock advances only where the test says (the source's delays, the training
step), so the attribution is checked exactly, whatever the host's load.
"""

from __future__ import annotations

import pytest

from recaccel.train.loop.data_wait import DataWait


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slow_source(clock: Clock, delays: list[float]):
    for i, d in enumerate(delays):
        clock.now += d  # producing batch i takes d seconds
        yield i


def test_first_batch_is_startup_and_the_rest_is_steady_wait():
    clock = Clock()
    wait = DataWait(clock)
    assert list(wait.wrap(slow_source(clock, [0.05, 0.01, 0.02, 0.0]))) == [0, 1, 2, 3]
    assert wait.batches == 4
    assert wait.startup_seconds == pytest.approx(0.05)
    assert wait.seconds == pytest.approx(0.03)


def test_consumer_time_is_not_wait():
    clock = Clock()
    wait = DataWait(clock)
    for _ in wait.wrap(slow_source(clock, [0.0, 0.0, 0.01, 0.0, 0.0])):
        clock.now += 0.02  # the training step
    assert wait.seconds == pytest.approx(0.01)
    assert wait.fraction(0.1) == pytest.approx(0.01 / 0.1)


def test_each_pass_has_its_own_startup_and_empty_passes_are_fine():
    clock = Clock()
    wait = DataWait(clock)
    for _ in range(2):
        list(wait.wrap(slow_source(clock, [0.03, 0.0])))
    list(wait.wrap([]))
    assert wait.batches == 4 and wait.startup_seconds == pytest.approx(0.06)
    assert wait.fraction(0.0) == 0.0
    assert wait.fraction(0.06) == 0.0  # all of it was start-up


def test_the_real_clock_counts_a_blocking_source():
    wait = DataWait()

    def blocking():
        import time

        for i in range(2):
            time.sleep(0.02)
            yield i

    list(wait.wrap(blocking()))
    assert wait.startup_seconds >= 0.02 and wait.seconds >= 0.02  # sleep never returns early
