"""``make gpu-check``'s small mode end to end, and the parts a GPU run leans on."""

from __future__ import annotations

import json
import os
import sys
import tarfile
import time

from recaccel.bench import gpu_check
from recaccel.bench.gpu_check_report import pytest_failures, pytest_summary
from recaccel.bench.gpu_check_targets import MET, NOT_MEASURED, NOT_MET, evaluate

TARGETS = (
    "embedding forward >= 70% of copy bandwidth",
    "embedding fwd+bwd+update >= 40% of copy bandwidth",
    "interaction fwd+bwd >= 2x eager",
    "bench_criteo_1hot >= 3x eager",
    "bench_criteo_1hot >= 6 M samples/s",
    "bench_wide >= 10x eager",
    "bench_criteo_1hot sync + CUDA graphs >= 1.3x off",
    "bench_wide sync + CUDA graphs >= 1.5x off",
    "data wait < 1% of step time",
)


def test_small_mode_runs_every_step_and_ends_with_the_targets(tmp_path, capsys):
    out = tmp_path / "check"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = printed[printed.index("== gpu-check summary") :]
    for target in TARGETS:  # the table comes last, one line per target
        assert f"| {target} |" in summary
    report = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert {k: status[k] for k in ("pytest", "embedding", "interaction", "io", "meta")} == dict.fromkeys(
        ("pytest", "embedding", "interaction", "io", "meta"), "ok"
    )
    assert status["train"] in ("ok", "skipped")  # skipped only while the benchmark is not registered
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    assert " passed" in report["pytest"]["summary"] and "passed" in (out / "pytest.txt").read_text()
    assert [t["target"] for t in report["targets"]] == list(TARGETS)
    # The io benchmark's debug run gives a data-wait figure even on CPU.
    assert report["targets"][-1]["status"] in (MET, NOT_MET) and report["targets"][-1]["value"] >= 0
    # What comes back from a lent machine: at most 8 files, flat; the rest in the tarball.
    left = sorted(p.name for p in out.iterdir())
    assert len(left) <= 8 and all(p.is_file() for p in out.iterdir())
    assert {"gpu_check.md", "gpu_check.json", "pytest.txt", "gpu_check_parts.tar.gz"} <= set(left)
    with tarfile.open(out / "gpu_check_parts.tar.gz") as tar:
        names = {m.rsplit("/", 1)[-1] for m in tar.getnames()}
    for bench in ("embedding", "interaction", "io", "meta"):
        assert f"{bench}.md" in names and f"{bench}.log" in names
    assert {"embedding.json", "interaction.json", "meta.json"} <= names
    md = (out / "gpu_check.md").read_text()
    assert "## Benchmark: embedding" in md and "## GPU targets" in md and "recaccel-bench io" in md


def test_a_step_past_its_budget_is_killed_with_what_it_started(tmp_path):
    marker = tmp_path / "child_alive"
    # The step starts a grandchild that would write a file after 3 s: killing the group stops it.
    script = tmp_path / "step.py"
    late = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    script.write_text(
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {late!r}])\ntime.sleep(30)\n"
    )
    log = tmp_path / "step.log"
    status, rc, seconds = gpu_check.run_step([sys.executable, str(script)], log, 1.0, dict(os.environ))
    assert (status, rc) == ("timeout", None) and seconds < 10
    time.sleep(3.5)
    assert not marker.exists()
    assert gpu_check.run_step([sys.executable, "-c", "raise SystemExit(3)"], log, 10, {})[:2] == ("failed", 3)


def test_clock_gives_each_step_its_budget_or_what_is_left():
    clock = gpu_check.Clock(total_s=100, reserve_s=10)
    assert clock.allowance(30) == 30
    assert 89 < clock.allowance(500) <= 90


def test_pytest_log_parsing():
    log = "tests/a.py::t PASSED\nFAILED tests/b.py::u - AssertionError: x\n= 1 failed, 4 passed, 90 deselected in 3.1s =\n"
    assert pytest_summary(log) == "1 failed, 4 passed, 90 deselected in 3.1s"
    assert pytest_failures(log) == ["FAILED tests/b.py::u - AssertionError: x"]
    assert pytest_summary("collecting ...\n") == ""


def _emb_row(mode, t, b, d, l, mb, **ms):
    return {
        "mode": mode,
        "T": t,
        "B": b,
        "D": d,
        "L": l,
        "MB_moved": mb,
        **{f"{k}_ms": v for k, v in ms.items()},
    }


def test_targets_from_result_files(tmp_path):
    # copy ceiling 1000 GB/s: 800 MB in 1 ms = 800 GB/s = 80%.
    emb = [
        _emb_row("forward", 26, 16384, 128, 1, 800.0, per_table=50.0, reference=4.0, triton=1.0),
        _emb_row("forward", 1000, 16384, 64, 1, 600.0, per_table=90.0, reference=9.0, triton=1.0),
        _emb_row("forward", 1, 512, 16, 1, 1.0, per_table=1.0, reference=1.0, triton=0.0001),  # out of range
        _emb_row("fwd+bwd+update", 26, 16384, 128, 1, 800.0, per_table=9.0, reference=2.0, fbgemm=0.1),
    ]
    (tmp_path / "embedding.json").write_text(json.dumps({"results": emb}))
    inter = [{"batch": 16384, "fields": 26, "dim": 128, "fwd_bwd_speedup": s} for s in (2.5, 1.5)]
    (tmp_path / "interaction.json").write_text(json.dumps({"results": inter}))
    train = [
        {"candidate": "recaccel", "preset": "configs/bench_criteo_1hot.toml", "batch": 65536,
         "samples_per_s": 7e6, "step_ms": 9.0, "speedup_vs_eager": 3.5, "phases_ms": {"data_wait": 0.0}},
        {"candidate": "recaccel", "preset": "bench_criteo_1hot", "data": "parquet reader", "batch": 65536,
         "samples_per_s": 5e6, "step_ms": 10.0, "speedup_vs_eager": 2.0, "phases_ms": {"data_wait": 0.5}},
        {"candidate": "eager", "preset": "bench_wide", "samples_per_s": 1e5, "step_ms": 9.0,
         "speedup_vs_eager": 1.0},
    ]  # fmt: skip
    (tmp_path / "train.json").write_text(json.dumps({"results": train}))
    got = {t["target"]: t for t in evaluate(tmp_path, {"copy_GBps": 1000.0})}
    fwd = got[TARGETS[0]]
    assert fwd["status"] == NOT_MET and abs(fwd["value"] - 0.6) < 1e-9 and "T=1000" in fwd["figure"]
    assert got[TARGETS[1]]["status"] == MET and "reference" in got[TARGETS[1]]["figure"]  # fbgemm is not ours
    assert got[TARGETS[2]]["status"] == NOT_MET and got[TARGETS[2]]["value"] == 1.5
    assert got[TARGETS[3]]["status"] == MET and got[TARGETS[3]]["value"] == 3.5  # device data, not the reader
    assert got[TARGETS[4]]["status"] == MET and got[TARGETS[4]]["value"] == 7e6
    assert got[TARGETS[5]]["status"] == NOT_MEASURED  # no recaccel row on bench_wide
    assert got[TARGETS[6]]["status"] == NOT_MEASURED and got[TARGETS[7]]["status"] == NOT_MEASURED
    assert got[TARGETS[8]]["status"] == NOT_MET and abs(got[TARGETS[8]]["value"] - 0.05) < 1e-12
    assert all(t["status"] == NOT_MEASURED for t in evaluate(tmp_path / "missing", {}))


def _pipeline_row(preset, mode, pipeline, micro, graphs, speedup, sps):
    return {"candidate": "recaccel", "preset": preset, "mode": mode, "batch": 4096, "pipeline": pipeline,
            "micro_batches": micro, "cuda_graphs": graphs, "speedup_vs_off": speedup,
            "samples_per_s": sps, "step_ms": 1.0, "speedup_vs_eager": 1.0}  # fmt: skip


def test_pipelined_targets_read_sync_with_graphs_against_off_on_device_data(tmp_path):
    train = [
        _pipeline_row("bench_criteo_1hot", "device", "off", 1, False, 1.0, 1e6),
        _pipeline_row("bench_criteo_1hot", "device", "sync", 2, True, 3.0, 3e6),  # not the target's row
        _pipeline_row("bench_criteo_1hot", "device", "sync", 1, True, 1.25, 1.25e6),
        _pipeline_row("bench_criteo_1hot", "reader", "sync", 1, True, 2.0, 2e6),
        _pipeline_row("bench_wide", "device", "semi_sync", 1, True, 1.7, 1e6),
        _pipeline_row("bench_wide", "device", "sync", 1, True, 1.6, 1e6),
        {"candidate": "recaccel", "preset": "bench_wide", "mode": "device", "pipeline": "sync",
         "micro_batches": 1, "cuda_graphs": True, "status": "skipped", "speedup_vs_off": None},
    ]  # fmt: skip
    (tmp_path / "train.json").write_text(json.dumps({"results": train}))
    got = {t["target"]: t for t in evaluate(tmp_path, {})}
    criteo, wide = got[TARGETS[6]], got[TARGETS[7]]
    assert (
        criteo["status"] == NOT_MET
        and criteo["value"] == 1.25
        and "through the reader 2.00x" in criteo["figure"]
    )
    assert wide["status"] == MET and wide["value"] == 1.6
    # recaccel's fastest row answers the samples/s target, its combination named.
    assert got[TARGETS[4]]["value"] == 3e6 and "sync/2/on" in got[TARGETS[4]]["figure"]


def test_git_commit_is_the_projects_own_or_unknown_never_a_parent_repositorys(tmp_path):
    import shutil
    import subprocess

    from recaccel.bench.common import PROJECT_ROOT, environment_info

    own = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    if own.returncode == 0:
        assert environment_info("cpu")["git_commit"] == own.stdout.strip()
    # The tree copied without its .git into another repository (as a lent machine runs it).
    outer = tmp_path / "outer"
    shutil.copytree(
        PROJECT_ROOT / "recaccel", outer / "copy" / "recaccel", ignore=shutil.ignore_patterns("__pycache__")
    )
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "parent"], check=True)
    code = "from recaccel.bench.common import _git_commit; print(_git_commit())"
    env = {**os.environ, "PYTHONPATH": str(outer / "copy")}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "unknown"
