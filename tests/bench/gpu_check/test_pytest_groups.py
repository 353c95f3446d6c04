"""gpu-check's pytest step: the GPU suite's files found by reading them, balanced over
groups, run as pytest processes at once under one deadline, logs and counts joined."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recaccel.bench.gpu_check.gpu_tests import gpu_test_files
from recaccel.bench.gpu_check.pytest_groups import (
    GroupResult,
    balance,
    join_logs,
    run_groups,
    sum_summaries,
)

REPO = Path(__file__).resolve().parents[3]


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_gpu_files_are_the_ones_that_mark_a_test_gpu_weighted_by_their_tests(tmp_path):
    tests = tmp_path / "tests"
    _write(
        tests,
        "a/test_one.py",
        "import pytest\npytestmark = pytest.mark.gpu\ndef test_a(): pass\ndef test_b(): pass\n",
    )
    _write(
        tests,
        "b/test_two.py",
        "import pytest\n@pytest.mark.gpu\ndef test_c(): pass\n@pytest.mark.skipif(True, reason='')\n"
        "@pytest.mark.gpu\ndef test_c2(): pass\ndef test_d(): pass\n",
    )
    _write(
        tests,
        "b/test_list.py",
        "import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.slow]\ndef test_h(): pass\n",
    )
    _write(
        tests,
        "c/test_alias.py",
        "import pytest\ngpu = pytest.mark.gpu\nslow = pytest.mark.slow\n@gpu\ndef test_i(): pass\n@slow\n"
        "def test_j(): pass\n@pytest.mark.parametrize('x', [1, pytest.param(2, marks=pytest.mark.gpu)])\n"
        "def test_k(x): pass\n",
    )
    _write(
        tests,
        "c/test_params.py",
        "import pytest\nDTYPES = {'f32': 1, 'bf16': 2}\nMODES = ['a', 'b', 'c']\n@pytest.mark.gpu\n"
        "@pytest.mark.parametrize('d', list(DTYPES))\n@pytest.mark.parametrize('m', MODES)\n"
        "@pytest.mark.parametrize('u', unknown())\ndef test_o(d, m, u): pass\n",
    )
    _write(
        tests,
        "c/test_fixture.py",
        "import pytest\n@pytest.fixture(params=['cpu', pytest.param('cuda', marks=pytest.mark.gpu)])\n"
        "def device(request): return request.param\n@pytest.fixture\ndef table(device): return device\n"
        "def test_l(device): pass\ndef test_m(table): pass\ndef test_n(): pass\n",
    )
    _write(tests, "b/test_cpu.py", "def test_e(): pass\n")
    _write(tests, "b/helper_gpu.py", "import pytest\npytestmark = pytest.mark.gpu\n")  # not a test file
    _write(tests, "b/test_gpux.py", "import pytest\nmark = pytest.mark.gpux\ndef test_f(): pass\n")
    _write(
        tests, "b/test_words.py", "TEXT = 'pytestmark = pytest.mark.gpu'\ndef test_g(): pass\n"
    )  # in a string
    assert gpu_test_files(tests, tmp_path) == [
        ("tests/a/test_one.py", 2),
        ("tests/b/test_list.py", 1),
        ("tests/b/test_two.py", 2),
        ("tests/c/test_alias.py", 2),
        ("tests/c/test_fixture.py", 2),
        ("tests/c/test_params.py", 6),  # 2 x 3 (an unknown list counts 1)
    ]


def test_balance_deals_every_file_once_into_groups_of_about_equal_weight():
    files = [(f"f{i:02d}.py", w) for i, w in enumerate([20, 1, 7, 7, 3, 12, 9, 2, 16, 5, 8, 4])]
    groups = balance(files, 4)
    assert sorted(f for g in groups for f in g) == sorted(f for f, _ in files)
    weight = dict(files)
    loads = [sum(weight[f] for f in g) for g in groups]
    assert len(groups) == 4 and max(loads) - min(loads) <= max(w for _, w in files) // 2
    assert balance(files, 4) == groups  # the same split every run
    assert balance(files[:2], 4) == [["f00.py"], ["f01.py"]]  # no empty group
    assert balance([], 4) == []
    assert balance(files, 1) == [sorted(weight)]


def test_the_files_read_are_the_files_pytest_collects_under_the_gpu_mark():
    """The reading of the marks agrees with pytest's own collection of this repository:
    the same files, and weights near the instances it collects."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "tests",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    counts = collections.Counter(line.split("::")[0] for line in done.stdout.splitlines() if "::" in line)
    assert counts, done.stdout[-2000:] + done.stderr[-2000:]
    weights = dict(gpu_test_files(REPO / "tests", REPO))
    assert set(weights) == set(counts)
    # Weights count the instances a literal parametrization shows; a computed one counts 1.
    assert all(1 <= weights[f] <= counts[f] for f in counts)
    assert sum(weights.values()) >= 0.8 * sum(counts.values())


def test_the_repositorys_gpu_suite_splits_into_four_balanced_groups():
    files = gpu_test_files(REPO / "tests", REPO)
    names = [f for f, _ in files]
    assert (
        "tests/ops/test_embedding_host_sync.py" in names
        and "tests/bench/gpu_check/test_pytest_groups.py" not in names
    )
    groups = balance(files, 4)
    weight = dict(files)
    loads = [sum(weight[f] for f in g) for g in groups]
    assert len(groups) == 4 and max(loads) <= 1.5 * sum(loads) / 4


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_groups_run_at_once_and_one_past_the_deadline_is_killed_with_its_children(tmp_path):
    child_pid = tmp_path / "child.pid"
    spawn_and_hang = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    argvs = [
        _python("import time; time.sleep(1.0); print('one')"),
        _python("import time, sys; time.sleep(1.0); print('two'); sys.exit(1)"),
        _python("import sys; sys.exit(5)"),  # pytest: nothing collected (every test skipped)
        _python(spawn_and_hang),
    ]
    logs = [tmp_path / f"g{i}.txt" for i in range(len(argvs))]
    t0 = time.monotonic()
    ended = run_groups(argvs, logs, 3.0, dict(os.environ), tmp_path)
    spent = time.monotonic() - t0
    assert [e.status for e in ended] == ["ok", "failed", "ok", "timeout"]
    assert [e.rc for e in ended] == [0, 1, 5, None]
    assert ended[0].seconds < 2.5 and ended[1].seconds < 2.5  # the two 1 s sleeps ran side by side
    assert 3.0 <= spent < 6.0
    assert logs[0].read_text().strip() == "one" and logs[1].read_text().strip() == "two"
    pid = int(child_pid.read_text())
    for _ in range(50):  # the killed group's own child is gone too (reaped by init)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the killed group's child {pid} still runs")


def test_a_group_deaf_to_the_interrupt_is_killed_when_the_grace_ends(tmp_path):
    deaf = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    polite = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('interrupted')\n"
    logs = [tmp_path / "deaf.txt", tmp_path / "polite.txt"]
    t0 = time.monotonic()
    ended = run_groups([_python(deaf), _python(polite)], logs, 2.0, dict(os.environ), tmp_path, grace_s=1.5)
    assert [e.status for e in ended] == ["timeout", "timeout"] and 3.5 <= time.monotonic() - t0 < 7.0
    assert logs[0].read_text().strip() == "up" and logs[1].read_text().strip() == "interrupted"


def test_logs_are_joined_under_a_line_naming_each_group(tmp_path):
    logs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    logs[0].write_text("FAILED tests/x.py::test_a - boom\n= 1 failed, 2 passed in 1.0s =\n")
    logs[1].write_text("tests/y.py::test_b PASSED\n")
    ended = [GroupResult("failed", 1, 1.0), GroupResult("timeout", None, 9.0)]
    text = join_logs(
        [["py", "-m", "pytest", "x.py"], ["py", "-m", "pytest", "y.py"]], logs, ended, tmp_path / "j.txt"
    )
    assert (tmp_path / "j.txt").read_text() == text
    lines = text.splitlines()
    assert lines[0].startswith("=== gpu-check pytest group 1/2: failed, 1 s: python -m pytest x.py")
    assert "=== gpu-check pytest group 2/2: timeout, 9 s: python -m pytest y.py" in lines
    assert lines[-1] == "gpu-check: group 2 killed at the budget"


def test_closing_lines_are_summed_in_pytests_words():
    lines = [
        "3 failed, 40 passed, 2 skipped, 100 deselected, 1 warning in 50.10s",
        "12 passed, 1 error, 3 warnings in 20.00s",
        "",
        "5 passed in 1.00s",
    ]
    assert (
        sum_summaries(lines, 61.234)
        == "3 failed, 57 passed, 2 skipped, 100 deselected, 1 error, 4 warnings in 61.23s"
    )
    assert sum_summaries(["no tests ran in 0.01s", ""], 1.0) == ""
    assert sum_summaries(["1 passed, 2 errors in 1s"], 2.0) == "1 passed, 2 errors in 2.00s"
