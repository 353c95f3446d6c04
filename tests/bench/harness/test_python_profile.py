"""The Python-function table of a profiled step (``python_hotspots``)."""

from __future__ import annotations

import cProfile
import time

import pytest

from recaccel.bench.harness.python_profile import function_label, python_hotspots


def _slow_part() -> None:
    time.sleep(0.002)


def _fast_part() -> int:
    return sum(range(10))


def _step() -> None:
    for _ in range(3):
        _fast_part()
    _slow_part()


def _row(lines: list[str], name: str) -> list[str]:
    return next(line for line in lines if line.endswith(f"({name})")).split()


def test_functions_are_ranked_by_own_time_with_calls_per_iteration():
    lines = python_hotspots(_step, iterations=4)
    assert lines[0].startswith("Python functions by own time, per iteration (cProfile, 4 iterations")
    slow, fast = _row(lines, "_slow_part"), _row(lines, "_fast_part")
    assert float(slow[2]) == 1.0 and float(fast[2]) == 3.0  # calls per iteration
    # _slow_part's own time is nothing (it waits in time.sleep, a builtin with its own row);
    # its cumulative time holds the sleep: 2 ms a call.
    assert float(slow[1]) >= 2.0 > float(slow[0])
    sleep = next(line for line in lines if line.endswith("<built-in method time.sleep>")).split()
    assert float(sleep[0]) >= 2.0
    own = [float(line.split()[0]) for line in lines[3:]]
    assert own == sorted(own, reverse=True)
    assert "/test_python_profile.py:" in slow[3]  # a file outside any package keeps its path


def test_rows_limit_the_table_and_iterations_must_be_positive():
    assert len(python_hotspots(_step, iterations=1, rows=2)) == 3 + 2
    with pytest.raises(ValueError, match="iterations must be >= 1, got 0"):
        python_hotspots(_step, iterations=0)


def test_a_profiler_already_active_gives_one_line(monkeypatch):
    def refuse(self):
        raise ValueError("Another profiling tool is already active")

    monkeypatch.setattr(cProfile.Profile, "enable", refuse)
    assert python_hotspots(_step, iterations=1) == [
        "no Python profile: Another profiling tool is already active"
    ]


@pytest.mark.parametrize(
    ("key", "label"),
    [
        (("/x/lib/python3.12/site-packages/torch/nn/modules/module.py", 1782, "_call_impl"),
         "torch/nn/modules/module.py:1782(_call_impl)"),
        (("/work/main/recaccel/ops/embedding/module.py", 212, "forward"), "recaccel/ops/embedding/module.py:212(forward)"),
        (("~", 0, "<method 'sort' of 'torch._C.TensorBase' objects>"), "<method 'sort' of 'torch._C.TensorBase' objects>"),
        (("/tmp/probe.py", 3, "step"), "/tmp/probe.py:3(step)"),
    ],
)  # fmt: skip
def test_function_labels_start_at_the_package(key, label):
    assert function_label(key) == label
