"""DataWait: time blocked in next() is attributed to start-up and steady state."""

from __future__ import annotations

import time

import pytest

from recaccel.train.data_wait import DataWait


def slow_source(delays: list[float]):
    for i, d in enumerate(delays):
        time.sleep(d)
        yield i


def test_first_batch_is_startup_and_the_rest_is_steady_wait():
    wait = DataWait()
    delays = [0.05, 0.01, 0.02, 0.0]
    assert list(wait.wrap(slow_source(delays))) == [0, 1, 2, 3]
    assert wait.batches == 4
    assert wait.startup_seconds == pytest.approx(0.05, abs=0.03)
    assert wait.seconds == pytest.approx(0.03, abs=0.03)
    assert wait.startup_seconds >= 0.05 and wait.seconds >= 0.03  # sleep never returns early


def test_consumer_time_is_not_wait():
    wait = DataWait()
    for _ in wait.wrap(slow_source([0.0] * 5)):
        time.sleep(0.02)  # the training step
    assert wait.seconds < 0.02
    assert wait.fraction(0.1) < 0.2


def test_each_pass_has_its_own_startup_and_empty_passes_are_fine():
    wait = DataWait()
    for _ in range(2):
        list(wait.wrap(slow_source([0.03, 0.0])))
    list(wait.wrap([]))
    assert wait.batches == 4 and wait.startup_seconds >= 0.06
    assert wait.fraction(0.0) == 0.0
