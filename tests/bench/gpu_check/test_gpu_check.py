"""``make gpu-check``'s small mode end to end, and the parts a GPU run leans on."""

from __future__ import annotations

import json
import os
import sys
import tarfile
import time

from recaccel.bench.gpu_check import runner as gpu_check
from recaccel.bench.gpu_check.plan import run_limit, select_steps
from recaccel.bench.gpu_check.report import pytest_failures, pytest_summary
from recaccel.bench.gpu_check.targets import MET, NOT_MEASURED, NOT_MET, evaluate, mark_not_run
from recaccel.bench.gpu_check.targets import TARGETS as TARGET_SPECS

TARGETS = tuple(t[0] for t in TARGET_SPECS)


def _small_mode_part(out, part, capsys) -> tuple[str, dict]:
    assert gpu_check.main(["--device", "cpu", "--part", part, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    stem = "gpu_check" if part == "checks" else f"gpu_check_{part}"
    return printed, json.loads((out / f"{stem}.json").read_text())


def _tar_names(path) -> set[str]:
    with tarfile.open(path) as tar:
        return {m.rsplit("/", 1)[-1] for m in tar.getnames()}


def test_small_mode_runs_both_parts_and_each_ends_with_the_targets(tmp_path, capsys):
    out = tmp_path / "check"
    printed, report = _small_mode_part(out, "checks", capsys)
    summary = printed[printed.index("== gpu-check summary (part checks") :]
    for target in TARGETS:  # the table comes last, one line per target
        assert f"| {target} |" in summary
    status = {s["name"]: s["status"] for s in report["steps"]}
    checks = ("pytest", "embedding", "interaction", "dcnv2", "cache_train", "meta")
    assert {k: status[k] for k in checks} == dict.fromkeys(checks, "ok")
    assert {k: status[k] for k in ("train", "train_dcnv2", "io")} == dict.fromkeys(
        ("train", "train_dcnv2", "io"), "skipped"
    )
    plan = printed[: printed.index("gpu-check: ceilings")]
    for step in checks:  # the plan names every step of the part with its budget, before any runs
        assert f"  {step} " in plan
    assert "recaccel-bench interaction --kind dcnv2" in plan and "recaccel-bench cache_train" in plan
    assert "not in this run: train (part steps), train_dcnv2 (part steps), io (part steps)" in plan
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    assert " passed" in report["pytest"]["summary"] and "passed" in (out / "pytest.txt").read_text()
    assert [t["target"] for t in report["targets"]] == list(TARGETS)
    got = {t["target"]: t for t in report["targets"]}
    # Measured on CPU too (judged against a GPU threshold): the cache figure.
    assert got["host tables at 10% cached >= 60% of all-device samples/s"]["value"] > 0
    assert got["criteo_1hot schema reader >= 12 M rows/s"]["status"] == "not measured (part steps)"
    names = _tar_names(out / "gpu_check_parts.tar.gz")
    for bench in ("embedding", "interaction", "dcnv2", "cache_train", "meta"):
        assert f"{bench}.md" in names and f"{bench}.log" in names
    assert {"embedding.json", "interaction.json", "meta.json", "test_seconds.json"} <= names
    # What comes back from a lent machine: at most 7 files, flat, two plots; the rest in the tarball.
    checks_files = sorted(p.name for p in out.iterdir())
    assert len(checks_files) <= 7 and all(p.is_file() for p in out.iterdir())
    assert {"gpu_check.md", "gpu_check.json", "pytest.txt", "gpu_check_parts.tar.gz"} <= set(checks_files)
    pngs = {n for n in names if n.endswith(".png")}
    assert len(pngs) > 2 and sorted(n for n in checks_files if n.endswith(".png")) == [
        "embedding.png",
        "interaction.png",
    ]
    md = (out / "gpu_check.md").read_text()
    assert "## Benchmark: embedding" in md and "## GPU targets" in md

    printed, report = _small_mode_part(out, "steps", capsys)
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status["io"] == "ok" and status["train_dcnv2"] == "ok" and status["pytest"] == "skipped"
    assert status["train"] in ("ok", "skipped")  # skipped only while the benchmark is not registered
    got = {t["target"]: t for t in report["targets"]}
    assert "workers=" in got["criteo_1hot schema reader >= 12 M rows/s"]["figure"]  # the io worker sweep
    # The checks part's result files are not read again: its targets are the other part's.
    assert (
        got["embedding forward >= 80% of copy bandwidth (triton)"]["status"] == "not measured (part checks)"
    )
    assert "pytest: not run (part checks)" in printed
    steps_files = sorted(set(p.name for p in out.iterdir()) - set(checks_files))
    assert len(steps_files) <= 5  # beside the kernel tuning run's three in one command's 8
    assert {"gpu_check_steps.md", "gpu_check_steps.json", "gpu_check_steps_parts.tar.gz"} <= set(steps_files)
    assert {"io.md", "io.log", "io.json", "train_dcnv2.json"} <= _tar_names(
        out / "gpu_check_steps_parts.tar.gz"
    )
    assert "recaccel-bench io" in (out / "gpu_check_steps.md").read_text()


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


def test_targets_judge_triton_precision_rows_and_the_data_cost_from_result_files(tmp_path):
    # copy ceiling 1000 GB/s: 800 MB in 1 ms = 800 GB/s = 80%.
    emb = [
        _emb_row("forward", 26, 16384, 128, 1, 800.0, per_table=50.0, reference=0.5, triton=1.0),
        _emb_row("forward", 100, 16384, 64, 20, 600.0, per_table=90.0, reference=0.1, triton=1.0),
        _emb_row("fwd+bwd+update", 26, 16384, 128, 1, 800.0, per_table=9.0, reference=0.1, triton=1.0),
    ]
    (tmp_path / "embedding.json").write_text(json.dumps({"results": emb}))
    row = {"candidate": "recaccel", "preset": "bench_criteo_1hot", "batch": 65536, "pipeline": "off",
           "micro_batches": 1, "cuda_graphs": False}  # fmt: skip
    train = [
        {**row, "mode": "device", "precision": "bf16", "samples_per_s": 13e6, "step_ms": 5.0},
        {**row, "mode": "device", "precision": "tf32", "samples_per_s": 7e6, "step_ms": 9.0},
        {**row, "mode": "reader", "precision": "bf16", "samples_per_s": 12e6, "step_ms": 5.5},
        {**row, "mode": "reader", "precision": "tf32", "samples_per_s": 7e6, "step_ms": 9.0},
    ]
    (tmp_path / "train.json").write_text(json.dumps({"results": train}))
    cache = {"rows": [{"candidate": "device", "vs_device": 1.0}, {"candidate": "host", "vs_device": 0.5}]}
    (tmp_path / "cache_train.json").write_text(json.dumps(cache))
    got = {t["target"]: t for t in evaluate(tmp_path, {"copy_GBps": 1000.0})}
    fwd = got["embedding forward >= 80% of copy bandwidth (triton)"]
    # The reference's faster figures are not judged: Triton's worst case is.
    assert fwd["status"] == NOT_MET and abs(fwd["value"] - 0.6) < 1e-9 and "T=100" in fwd["figure"]
    assert got["embedding fwd+bwd+update >= 50% of copy bandwidth (triton)"]["status"] == MET
    assert got["bench_criteo_1hot bf16 >= 12 M samples/s"]["value"] == 13e6
    assert got["bench_criteo_1hot tf32 >= 8 M samples/s"]["status"] == NOT_MET
    assert got["bench_wide bf16 >= 0.8 M samples/s"]["status"] == NOT_MEASURED
    cost = got["data cost < 2% of step time"]
    assert cost["status"] == NOT_MET and abs(cost["value"] - 0.5 / 5.5) < 1e-12  # (reader - device) / reader
    assert got["host tables at 10% cached >= 60% of all-device samples/s"]["status"] == NOT_MET
    assert all(t["status"] == NOT_MEASURED for t in evaluate(tmp_path / "missing", {}))


def test_the_interaction_targets_read_the_roofline_rows_and_the_phased_step(tmp_path):
    def dot(b, f, d, precision, frac, speedup):
        return {"batch": b, "fields": f, "dim": d, "precision": precision,
                "triton_fwd_bwd_bw_frac": frac, "fwd_speedup": speedup}  # fmt: skip

    rows = [dot(65536, 26, 128, "bfloat16", 0.7, 1.8), dot(4096, 500, 32, "tf32", 0.4, 1.2)]
    (tmp_path / "interaction.json").write_text(json.dumps({"results": rows}))
    train = [{"candidate": "recaccel", "preset": "bench_criteo_1hot", "mode": "device", "batch": 65536,
              "pipeline": "off", "micro_batches": 1, "cuda_graphs": False, "precision": "bf16",
              "step_ms": 6.0, "samples_per_s": 1e7, "dense_head_TFLOPs": 300.0,
              "phases_ms": {"embedding_forward": 0.4, "sparse_update": 0.5}}]  # fmt: skip
    (tmp_path / "train.json").write_text(json.dumps({"results": train}))
    got = {t["target"]: t for t in evaluate(tmp_path, {"copy_GBps": 1000.0, "matmul_TFLOPs": 800.0})}
    roofline = got["interaction fwd+bwd >= 60% of its byte roofline (bf16, tf32)"]
    assert roofline["status"] == NOT_MET and roofline["value"] == 0.4 and "F=500" in roofline["figure"]
    assert got["interaction forward faster than eager at every shape"]["status"] == MET
    lookup = got["bench_criteo_1hot lookup + sparse update <= 1.0 ms"]
    assert lookup["status"] == MET and abs(lookup["value"] - 0.9) < 1e-12
    head = got["dense head >= 50% of the bf16 matmul rate"]
    assert head["status"] == NOT_MET and head["value"] == 300.0 / 800.0


def test_the_cross_network_target_reads_the_default_kernels_speedup_as_its_benchmark_writes_it(tmp_path):
    """The DCN-v2 row's speedups are per kernel (gemm_, fused_): the target reads gemm's,
    the default kernel's (the H200 run of session 15 read a dot-interaction key and showed
    "not measured" beside a finished benchmark)."""
    row = {"batch": 16384, "fields": 26, "dim": 128, "dtype": "bfloat16", "device": "cuda"}
    for kernel in ("gemm", "fused"):
        row |= {f"{kernel}_fwd_ms": 1.0, f"{kernel}_fwd_bwd_ms": 3.0}
    row |= {
        "eager_fwd_ms": 1.0,
        "eager_fwd_bwd_ms": 3.3,
        "gemm_fwd_bwd_speedup": 1.1,
        "fused_fwd_bwd_speedup": 0.6,
    }
    (tmp_path / "dcnv2.json").write_text(json.dumps({"results": [row]}))
    got = {t["target"]: t for t in evaluate(tmp_path, {"copy_GBps": 1000.0, "matmul_TFLOPs": 800.0})}
    cross = got["DCN-v2 cross fwd+bwd >= 1.5x eager (bf16)"]
    assert cross["status"] == NOT_MET and cross["value"] == 1.1 and "B=16384" in cross["figure"]


def _pipeline_row(preset, mode, pipeline, micro, graphs, speedup, sps):
    return {"candidate": "recaccel", "preset": preset, "mode": mode, "batch": 4096, "pipeline": pipeline,
            "micro_batches": micro, "cuda_graphs": graphs, "speedup_vs_off": speedup,
            "samples_per_s": sps, "step_ms": 1.0, "speedup_vs_eager": 1.0}  # fmt: skip


def test_pipelined_targets_read_sync_with_graphs_against_off_on_device_data(tmp_path):
    train = [
        _pipeline_row("bench_criteo_1hot", "device", "off", 1, False, 1.0, 1e6),
        _pipeline_row("bench_criteo_1hot", "device", "sync", 2, True, 3.0, 3e6),  # not the target's row
        _pipeline_row("bench_criteo_1hot", "device", "sync", 1, True, 1.1, 1.1e6),
        _pipeline_row("bench_criteo_1hot", "reader", "sync", 1, True, 2.0, 2e6),
        _pipeline_row("bench_wide", "device", "sync", 1, True, 1.2, 1e6),
    ]
    (tmp_path / "train.json").write_text(json.dumps({"results": train}))
    got = {t["target"]: t for t in evaluate(tmp_path, {})}
    criteo = got["bench_criteo_1hot sync + CUDA graphs >= 1.15x off"]
    wide = got["bench_wide sync + CUDA graphs >= 1.15x off"]
    assert (
        criteo["status"] == NOT_MET
        and criteo["value"] == 1.1
        and "through the reader 2.00x" in criteo["figure"]
    )
    assert wide["status"] == MET and wide["value"] == 1.2


def test_git_commit_is_the_projects_own_or_unknown_never_a_parent_repositorys(tmp_path):
    import shutil
    import subprocess

    from recaccel.bench.harness.environment import PROJECT_ROOT, environment_info

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
    code = "from recaccel.bench.harness.environment import _git_commit; print(_git_commit())"
    env = {**os.environ, "PYTHONPATH": str(outer / "copy")}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "unknown"


def test_each_gpu_part_fits_seven_minutes_and_its_plan_names_what_runs_elsewhere():
    assert set(gpu_check.STEPS) == {s for steps in gpu_check.PARTS.values() for s in steps}
    for part, steps in gpu_check.PARTS.items():
        limit = run_limit(steps, "cuda")
        steps_s = sum(gpu_check.BUDGETS[s][0] for s in steps)
        # The ceilings (~15 s on the H200) and the clock's reserve beside the steps' budgets.
        assert steps_s + 20 <= limit <= gpu_check.TOTAL_BUDGET_S["cuda"] <= 330
        plan = gpu_check.plan_text(steps, "cuda", limit, part)
        assert f"part {part}, cuda" in plan and f"steps {steps_s} s" in plan
        assert all(f"  {s} " in plan for s in steps)
        others = [s for s in gpu_check.STEPS if s not in steps]
        assert all(f"{s} (part " in plan for s in others)
    steps_plan = gpu_check.plan_text(gpu_check.PARTS["steps"], "cuda", 325, "steps")
    assert "bench_dcnv2_mlperf" in steps_plan and "overlap/1/off" in steps_plan.split("outside gpu-check:")[1]
    # The targets read off/1/off and sync/1/on; the exact overlapped step runs outside.
    assert "off/1/off,sync/1/on" in steps_plan and "overlap" not in steps_plan.split("outside")[0]


def test_only_picks_steps_of_either_part_and_the_part_selects_its_own():
    assert select_steps("checks", None) == gpu_check.PARTS["checks"]
    assert select_steps("steps", None) == ("train", "train_dcnv2", "io")
    assert select_steps("all", None) == gpu_check.STEPS
    assert select_steps("steps", "meta, io") == ("io", "meta")  # over parts, in step order
    assert run_limit(("io", "meta"), "cuda") == gpu_check.BUDGETS["io"][0] + gpu_check.BUDGETS["meta"][0] + 25


def test_a_bad_step_name_is_one_line_and_exit_status_2(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--only", "pytest,trian", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu-check: error: unknown step(s) ['trian']") and "\n" not in err
    assert not any(tmp_path.iterdir())


def test_targets_of_a_step_that_did_not_run_read_not_measured_whatever_files_lie_there(tmp_path):
    row = {"candidate": "recaccel", "preset": "bench_criteo_1hot", "mode": "device", "precision": "bf16",
           "samples_per_s": 13e6, "step_ms": 5.0, "pipeline": "off", "micro_batches": 1, "cuda_graphs": False}  # fmt: skip
    (tmp_path / "train.json").write_text(json.dumps({"results": [row]}))
    target = "bench_criteo_1hot bf16 >= 12 M samples/s"
    assert {t["target"]: t for t in evaluate(tmp_path, {})}[target]["status"] == MET
    rows = mark_not_run(evaluate(tmp_path, {}), {"train": "part steps", "train_dcnv2": "part steps"})
    got = {t["target"]: t for t in rows}
    assert got[target]["status"] == "not measured (part steps)" and got[target]["value"] is None
    assert got["bench_dcnv2_mlperf >= 3 M samples/s"]["status"] == "not measured (part steps)"
    assert got["interaction forward faster than eager at every shape"]["status"] == NOT_MEASURED
