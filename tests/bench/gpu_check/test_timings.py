"""gpu-check's pytest weights: seconds per GPU test file from the committed JSON (or a
fallback by test count), the groups they balance, and per-file seconds summed from junit XML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from recaccel.bench.gpu_check import runner, timings
from recaccel.bench.gpu_check.gpu_tests import gpu_test_files
from recaccel.bench.gpu_check.pytest_groups import balance, run_groups
from recaccel.bench.gpu_check.report import pytest_summary

REPO = Path(__file__).resolve().parents[3]


def _seconds_file(path: Path, files: dict[str, float]) -> Path:
    entries = {name: {"seconds": s, "source": "test"} for name, s in files.items()}
    path.write_text(json.dumps({"device": "test GPU", "files": entries}))
    return path


def test_weights_are_the_files_seconds_else_their_count_times_the_median_per_test(tmp_path):
    data = timings.load_seconds(_seconds_file(tmp_path / "s.json", {"a.py": 40.0, "b.py": 6.0, "c.py": 9.0}))
    known = timings.file_seconds(data)
    assert known == {"a.py": 40.0, "b.py": 6.0, "c.py": 9.0}
    # Seconds per test of the known files: 40/2, 6/3, 9/1 -> median 9.
    got = dict(timings.weights([("a.py", 2), ("b.py", 3), ("c.py", 1), ("new.py", 4)], known))
    assert got == {"a.py": 40.0, "b.py": 6.0, "c.py": 9.0, "new.py": 36.0}
    assert dict(timings.weights([("x.py", 3)], {})) == {"x.py": 3 * timings.DEFAULT_SECONDS_PER_TEST}
    # A file measured at 0 s (its tests all skipped) keeps 0 and leaves the median alone.
    known_skip = timings.file_seconds(
        timings.load_seconds(
            _seconds_file(tmp_path / "z.json", {"a.py": 40.0, "b.py": 6.0, "c.py": 9.0, "z.py": 0.0})
        )
    )
    got = dict(
        timings.weights([("a.py", 2), ("b.py", 3), ("c.py", 1), ("z.py", 5), ("new.py", 4)], known_skip)
    )
    assert got["z.py"] == 0.0 and got["new.py"] == 36.0
    assert timings.load_seconds(tmp_path / "absent.json") == {"device": "", "files": {}}
    (tmp_path / "bad.json").write_text("{not json")
    assert timings.file_seconds(timings.load_seconds(tmp_path / "bad.json")) == {}


def test_the_committed_seconds_cover_the_gpu_suite_and_say_where_each_figure_comes_from():
    data = timings.load_seconds()
    files = dict(gpu_test_files(REPO / "tests", REPO))
    known = timings.file_seconds(data)
    assert "H200" in data["device"] and set(known) == set(data["files"])  # every entry has its seconds
    assert all(entry["source"] for entry in data["files"].values())
    # Files added since weigh by their test count (the fallback); most are measured.
    assert len(set(known) & set(files)) >= 0.8 * len(files)
    # Measured on the H200 (session 15): ~310 s of work, four groups of ~80 s in 120 s each.
    assert 200 < sum(known.values()) < 4 * 100


def test_balancing_by_seconds_separates_the_slow_files_that_counts_put_together():
    # Counts mislead: two slow files of few tests and many fast files of many tests.
    counts = [("slow_a.py", 4), ("slow_b.py", 9), ("slow_c.py", 2)] + [(f"fast{i}.py", 20) for i in range(5)]
    seconds = {"slow_a.py": 50.0, "slow_b.py": 50.0, "slow_c.py": 40.0}
    seconds.update({f"fast{i}.py": 5.0 for i in range(5)})
    by_count = balance(counts, 3)
    by_seconds = balance(timings.weights(counts, seconds), 3)
    load = lambda groups: max(sum(seconds[f] for f in g) for g in groups)  # noqa: E731
    assert any(sum(f.startswith("slow") for f in g) >= 2 for g in by_count)  # the H200's 91 s groups
    assert all(sum(f.startswith("slow") for f in g) == 1 for g in by_seconds)
    assert load(by_seconds) <= 55.0 < load(by_count)


def test_the_repositorys_gpu_suite_splits_into_four_groups_of_about_equal_seconds():
    weighted = timings.weights(
        gpu_test_files(REPO / "tests", REPO), timings.file_seconds(timings.load_seconds())
    )
    weight = dict(weighted)
    loads = [sum(weight[f] for f in g) for g in balance(weighted, 4)]
    # No group over the heaviest file or a quarter of the whole with a tenth to spare.
    assert max(loads) <= max(max(weight.values()), 1.1 * sum(loads) / 4)


def _junit(path: Path, cases: list[tuple[str, str, str, float]]) -> Path:
    body = "".join(
        f'<testcase classname="{cls}" name="{name}"{f" file={chr(34)}{file}{chr(34)}" if file else ""} time="{t}"/>'
        for cls, name, file, t in cases
    )
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'
    )
    return path


def test_junit_times_sum_per_test_file_from_the_file_or_the_class_path(tmp_path):
    files = ["tests/ops/test_a.py", "tests/ops/test_ab.py", "tests/train/test_b.py"]
    one = _junit(
        tmp_path / "g0.xml",
        [
            ("tests.ops.test_a", "test_x", "tests/ops/test_a.py", 1.25),  # xunit1 names the file
            ("tests.ops.test_a.TestK", "test_y[cuda]", "", 2.5),  # xunit2: the class path only
            ("tests.ops.test_ab", "test_z", "", 0.5),  # not test_a's, though it starts alike
        ],
    )
    two = _junit(
        tmp_path / "g1.xml", [("tests.train.test_b", "test_w", "", 3.0), ("elsewhere", "t", "", 9.0)]
    )
    (tmp_path / "g2.xml").write_text("<testsuites><testsuite")  # a group killed while writing
    got = timings.junit_seconds([one, two, tmp_path / "g2.xml", tmp_path / "killed.xml"], files)
    assert got == {"tests/ops/test_a.py": 3.75, "tests/ops/test_ab.py": 0.5, "tests/train/test_b.py": 3.0}


def test_the_measured_file_keeps_the_committed_figures_of_files_not_run(tmp_path):
    committed = {
        "device": "H200",
        "files": {"a.py": {"seconds": 40.0, "source": "seed"}, "b.py": {"seconds": 6.0, "source": "seed"}},
    }
    got = timings.measured_file(committed, {"b.py": 7.5, "c.py": 1.0}, "NVIDIA H100", "gpu-check 2026-11-27")
    assert got["device"] == "NVIDIA H100" and list(got["files"]) == ["a.py", "b.py", "c.py"]
    assert got["files"]["a.py"] == {"seconds": 40.0, "source": "seed"}
    assert got["files"]["b.py"]["seconds"] == 7.5 and "gpu-check 2026-11-27" in got["files"]["b.py"]["source"]
    assert timings.file_seconds(got) == {"a.py": 40.0, "b.py": 7.5, "c.py": 1.0}  # readable as weights


def test_a_real_pytest_group_writes_junit_that_becomes_per_file_seconds(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_slow.py").write_text("import time\ndef test_s():\n    time.sleep(0.3)\n")
    (tests / "test_quick.py").write_text("def test_q():\n    pass\ndef test_r():\n    pass\n")
    argv = runner.pytest_groups("cpu", tmp_path)[0]
    assert all(option in argv for option in runner.junit_options(tmp_path, 0))  # the step's own options
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *runner.junit_options(tmp_path, 0),
         "tests/test_slow.py", "tests/test_quick.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    measured = timings.write_measured(
        tmp_path / "test_seconds.json", [tmp_path / "pytest_group0.xml"],
        ["tests/test_slow.py", "tests/test_quick.py"], "CPU", "gpu-check test",
    )  # fmt: skip
    assert set(measured) == {"tests/test_slow.py", "tests/test_quick.py"}
    assert measured["tests/test_slow.py"] >= 0.3 > measured["tests/test_quick.py"]
    written = json.loads((tmp_path / "test_seconds.json").read_text())
    assert (
        written["device"] == "CPU"
        and written["files"]["tests/test_slow.py"]["seconds"] == measured["tests/test_slow.py"]
    )


def test_a_group_stopped_at_the_budget_still_measures_the_files_it_finished(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_first.py").write_text("import time\ndef test_a():\n    time.sleep(0.2)\n")
    (tests / "test_second.py").write_text(
        "def test_b():\n    pass\ndef test_c():\n    import time; time.sleep(60)\n"
    )
    (tests / "test_never.py").write_text("def test_d():\n    pass\n")
    names = ["tests/test_first.py", "tests/test_second.py", "tests/test_never.py"]
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *runner.junit_options(tmp_path, 0),
        *names,
    ]
    log = tmp_path / "group.txt"
    ended = run_groups([argv], [log], 4.0, dict(os.environ), tmp_path, grace_s=10.0)
    assert ended[0].status == "timeout" and ended[0].seconds < 10
    # Interrupted, pytest ended its session: its closing line and its junit XML.
    assert "KeyboardInterrupt" in log.read_text() and "2 passed" in pytest_summary(log.read_text())
    xml = tmp_path / "pytest_group0.xml"
    assert set(timings.junit_seconds([xml], names)) == {"tests/test_first.py", "tests/test_second.py"}
    # The file it was in when stopped is left out (only part of it ran); the one never reached too.
    assert set(timings.junit_seconds([xml], names, interrupted=[xml])) == {"tests/test_first.py"}


def test_the_pytest_step_stopped_at_its_budget_names_only_the_unfinished_files_to_rerun(
    tmp_path, monkeypatch
):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_done.py").write_text("def test_a():\n    pass\n")
    # Stopped in its second test: the file is part run, its first test in the XML.
    (tests / "test_hang.py").write_text(
        "import time\ndef test_g():\n    pass\ndef test_h():\n    time.sleep(60)\n"
    )
    done, hang = str(tests / "test_done.py"), str(tests / "test_hang.py")
    monkeypatch.setattr(runner, "CPU_PYTEST", [done, hang])  # the small mode's selection: these two files
    parts = tmp_path / "parts"
    parts.mkdir()
    step, info = runner._run_pytest("cpu", tmp_path, parts, runner.Clock(60, reserve_s=0), 6, "CPU")
    assert step.status == "timeout" and step.seconds < 10
    assert step.note.endswith(f"the rest: python -m pytest -m gpu {hang}") and "2 passed" in step.note
    assert list(info["file_seconds"]) == [done]
    written = json.loads((parts / "test_seconds.json").read_text())
    assert written["device"] == "CPU" and done in written["files"] and hang not in written["files"]
    assert not list(parts.glob("*.xml")) and (tmp_path / "pytest.txt").is_file()


def test_gpu_groups_fail_a_slow_test_alone_where_pytest_timeout_is_installed(tmp_path, monkeypatch):
    """With the plugin, each GPU group gets a per-test limit (a stuck test fails with its
    stack, the group's later files still run); without it, no option pytest would reject."""
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(runner, "find_spec", lambda name: object() if name == "pytest_timeout" else None)
    groups = runner.pytest_groups("cuda", tmp_path)
    limit = f"--timeout={runner.PER_TEST_TIMEOUT_S}"
    assert groups and all(limit in argv and "--timeout-method=signal" in argv for argv in groups)
    monkeypatch.setattr(runner, "find_spec", lambda name: None)
    groups = runner.pytest_groups("cuda", tmp_path)
    assert not any(a.startswith("--timeout") for argv in groups for a in argv)
    # pytest's own stack dump of a test past STACK_DUMP_S needs no plugin.
    assert all(f"faulthandler_timeout={runner.STACK_DUMP_S}" in argv for argv in groups)


def test_a_test_past_the_stack_dump_time_prints_where_it_is_and_goes_on(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_stuck.py").write_text(
        "import time\ndef test_slow_here():\n    time.sleep(1.5)\ndef test_after():\n    pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=0.5",
         "tests/test_stuck.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0 and "2 passed" in text
    assert "Timeout" in text and "test_slow_here" in text  # the stack of the slow test
