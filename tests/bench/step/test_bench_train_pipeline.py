"""``recaccel-bench train --pipeline ... --micro-batches ... --cuda-graphs ...``: the lists
parse, every combination is a JSON row with its fields (or a skip with the trainer's
one-line reason), speedups are against the same run's ``off/1/off``, and the timeline of
a sync step is drawn from the profiler's trace."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch

from recaccel.bench.step import report as train_report
from recaccel.bench.step import train as train_bench
from recaccel.bench.step.candidates import BASELINE, Combination, parse_combinations, recaccel_candidates
from recaccel.bench.step.data import RotatingBatches, device_batches, load_preset, make_dataset, rows_needed
from recaccel.bench.step.timeline import _labelled, labelled_phases, record_timeline
from recaccel.cli import bench_main
from recaccel.config import TrainConfig
from recaccel.errors import ConfigError
from recaccel.plotting.timeline import (
    BACKWARD,
    DATA,
    FORWARD,
    LOOKUP,
    OTHER,
    PREPARE,
    SPARSE,
    kernel_table,
    spans_from_trace,
)


def test_the_cli_parses_comma_lists_into_every_combination_baseline_first():
    parser = argparse.ArgumentParser()
    train_bench.add_args(parser)
    args = parser.parse_args(
        ["--pipeline", "sync,semi_sync,off", "--micro-batches", "1,2,4", "--cuda-graphs", "on,off,step"]
    )
    found = parse_combinations(args.pipeline, args.micro_batches, args.cuda_graphs)
    assert found[0] == BASELINE
    assert len(found) == len(set(found)) == 3 * 3 * 3
    assert found[1] == Combination("sync", 1, "on")  # then the lists' order
    assert {c.label for c in found} >= {"sync/2/on", "semi_sync/4/off", "off/1/off", "sync/1/step"}
    step = Combination("sync", 1, "step").train_config(TrainConfig())
    assert (step.cuda_graphs, step.cuda_graph_scope) == (True, "step")
    head = Combination("sync", 1, "on").train_config(TrainConfig())
    assert (head.cuda_graphs, head.cuda_graph_scope) == (True, "head")
    with pytest.raises(ConfigError, match="--cuda-graphs 'all' is not one of off, on, step"):
        parse_combinations("off", "1", "all")
    defaults = parser.parse_args([])
    assert parse_combinations(defaults.pipeline, defaults.micro_batches, defaults.cuda_graphs) == [BASELINE]


def test_explicit_combination_labels_replace_the_lists():
    found = parse_combinations("sync", "4", "on", "sync/1/on,sync/2/on,semi_sync/1/on,off/1/off")
    assert [c.label for c in found] == ["off/1/off", "sync/1/on", "sync/2/on", "semi_sync/1/on"]
    for bad, flag in (
        ("sync/1", "--combinations"),
        ("fast/1/on", "--pipeline"),
        ("sync/x/on", "--micro-batches"),
    ):
        with pytest.raises(ConfigError, match=flag):
            parse_combinations("off", "1", "off", bad)


@pytest.mark.parametrize(
    "lists, flag",
    [
        (("off,async", "1", "off"), "--pipeline"),
        (("off", "1,0", "off"), "--micro-batches"),
        (("off", "two", "off"), "--micro-batches"),
        (("off", "1", "off,maybe"), "--cuda-graphs"),
        ((",", "1", "off"), "--pipeline"),
    ],
)
def test_a_bad_list_value_is_one_line_naming_its_flag(lists, flag):
    with pytest.raises(ConfigError, match=flag) as e:
        parse_combinations(*lists)
    assert "\n" not in str(e.value)


def _run(tmp_path, tiny, *extra):
    argv = [
        "train",
        "--preset",
        str(tiny),
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--phase-steps",
        "1",
        "--rotate",
        "2",
        "--candidates",
        "recaccel",
        "eager",
        "--pipeline",
        "off,sync,semi_sync",
        "--micro-batches",
        "1,2",
        "--cuda-graphs",
        "off,on,step",
        "--timeline-steps",
        "2",
        "--out",
        str(tmp_path / "train.md"),
        "--json",
        str(tmp_path / "train.json"),
        *extra,
    ]
    assert bench_main(argv) == 0
    return json.loads((tmp_path / "train.json").read_text())["results"]


def test_every_combination_is_a_row_with_its_fields_skips_with_the_trainers_reason(tmp_path, tiny):
    rows = _run(tmp_path, tiny)
    mine = [r for r in rows if r["candidate"] == "recaccel"]
    assert len(mine) == 3 * 2 * 3 * 2  # combinations x {device, reader}
    for r in rows:
        assert {"pipeline", "micro_batches", "cuda_graphs", "speedup_vs_off"} <= set(r)
    for r in mine:
        combination = Combination(r["pipeline"], r["micro_batches"], r["cuda_graphs"])
        if combination.pipeline == "semi_sync" and combination.micro_batches > 1:  # TrainConfig's check
            assert r["status"] == "skipped"
            assert r["reason"].startswith("config keys train.pipeline=semi_sync and train.micro_batches=2")
        elif r["cuda_graphs"] == "step" and (r["pipeline"] == "semi_sync" or r["micro_batches"] > 1):
            assert r["status"] == "skipped"  # TrainConfig's check: one graph, one batch
            assert r["reason"].startswith("config keys train.cuda_graph_scope=step and train.")
        elif r["cuda_graphs"] != "off":  # a CPU run cannot capture: the ConfigError of build_head
            assert r["status"] == "skipped"
            assert r["reason"].startswith("train.cuda_graphs=true captures CUDA graphs")
        else:
            assert r["status"] == "ok", r
            assert r["step_ms"] > 0 and r["samples_per_s"] == pytest.approx(32 / (r["step_ms"] * 1e-3))
        if r["status"] == "skipped":
            assert "\n" not in r["reason"] and r["step_ms"] is None and r["speedup_vs_off"] is None
    eager = [r for r in rows if r["candidate"] == "eager"]
    assert all(
        (r["pipeline"], r["micro_batches"], r["cuda_graphs"], r["speedup_vs_off"]) == (None,) * 4
        for r in eager
    )
    ok = {(r["mode"], r["pipeline"], r["micro_batches"]) for r in mine if r["status"] == "ok"}
    assert ok == {
        (m, p, k)
        for m in ("device", "reader")
        for p, k in [("off", 1), ("off", 2), ("sync", 1), ("sync", 2), ("semi_sync", 1)]
    }
    for mode in ("device", "reader"):
        off = next(
            r
            for r in mine
            if r["mode"] == mode
            and r["status"] == "ok"
            and r["pipeline"] == "off"
            and r["micro_batches"] == 1
        )
        assert off["speedup_vs_off"] == 1.0
        assert isinstance(off["phases_ms"]["backward"], float)  # the baseline is instrumented
        for r in mine:
            if r["mode"] == mode and r["status"] == "ok":
                assert r["speedup_vs_off"] == pytest.approx(off["step_ms"] / r["step_ms"])
    text = (tmp_path / "train.md").read_text()
    assert "## recaccel: pipeline / micro-batches / CUDA graphs" in text
    assert "skipped: train.cuda_graphs=true" in text
    picture = tmp_path / "train_timeline_tiny.png"
    assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({picture.name})" in text
    kernels = (tmp_path / "train_timeline_tiny_kernels.md").read_text()  # no CUDA work on CPU: no rows
    assert kernels.startswith("# Kernels per step: tiny") and "| kernel | phase |" in kernels
    assert "Self CPU" in (tmp_path / "train_timeline_tiny_host.txt").read_text()
    python = (tmp_path / "train_timeline_tiny_python.txt").read_text()
    assert python.startswith("Python functions by own time, per iteration (cProfile, ")
    assert "recaccel/train/loop/" in python  # the trainer's loop is what ran
    assert "train_timeline_tiny_python.txt" in text


def test_no_timeline_without_a_sync_combination(tmp_path, tiny):
    _run(
        tmp_path,
        tiny,
        "--pipeline",
        "off",
        "--mode",
        "device",
        "--micro-batches",
        "1",
        "--cuda-graphs",
        "off",
    )
    assert not (tmp_path / "train_timeline_tiny.png").exists()


def test_speedups_are_against_the_baseline_of_the_same_preset_and_mode():
    def row(preset, mode, candidate, pipeline, ms):
        combo = (pipeline, 1, False) if pipeline else (None, None, None)
        return dict(
            zip(("pipeline", "micro_batches", "cuda_graphs"), combo),
            preset=preset,
            mode=mode,
            candidate=candidate,
            step_ms=ms,
        )

    rows = [
        row("a", "device", "recaccel", "off", 10.0),
        row("a", "device", "recaccel", "sync", 5.0),
        row("a", "reader", "recaccel", "off", 40.0),
        row("a", "reader", "recaccel", "sync", 20.0),
        row("b", "device", "recaccel", "sync", 3.0),  # no baseline in this group
        row("a", "device", "eager", None, 30.0),
    ]
    train_report.speedups(rows)
    assert [r["speedup_vs_off"] for r in rows] == [1.0, 2.0, 1.0, 2.0, None, None]
    assert rows[1]["speedup_vs_eager"] == 6.0 and rows[2]["speedup_vs_eager"] is None
    note = train_report.cpu_target_note(rows)
    assert note.startswith("CPU target") and ": met;" in note and "sync/1/off on a (device) at 2.000x" in note
    rows[1]["speedup_vs_off"] = 0.9
    assert ": not met;" in train_report.cpu_target_note(rows)


def _trace():
    """A CUDA-shaped Chrome trace: host labels on the main thread, a backward node on the
    autograd thread, kernels on two streams launched from inside them."""

    def x(name, tid, ts, dur, cat="user_annotation", **args):
        return {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur, "cat": cat, "args": args}

    return {
        "traceEvents": [
            x("recaccel-bench/step", 1, 1000.0, 900.0),
            x("recaccel-bench/data / copy", 1, 1000.0, 50.0),
            x("recaccel-bench/prepare", 1, 1060.0, 100.0),
            x("cudaLaunchKernel", 1, 1070.0, 5.0, "cuda_runtime", correlation=7),
            x("recaccel-bench/embedding lookup", 1, 1200.0, 100.0),
            x("cudaLaunchKernel", 1, 1210.0, 5.0, "cuda_runtime", correlation=8),
            x("recaccel-bench/dense forward", 1, 1300.0, 100.0),
            x("cudaLaunchKernel", 1, 1310.0, 5.0, "cuda_runtime", correlation=9),
            x("autograd::engine::evaluate_function: AddmmBackward0", 2, 1500.0, 50.0, "cpu_op"),
            x("cudaLaunchKernel", 2, 1510.0, 5.0, "cuda_runtime", correlation=10),
            x(
                "autograd::engine::evaluate_function: TritonFusedEmbeddingBagFunctionBackward",
                2,
                1600.0,
                50.0,
                "cpu_op",
            ),
            x("cudaLaunchKernel", 2, 1610.0, 5.0, "cuda_runtime", correlation=11),
            x("cudaLaunchKernel", 1, 1950.0, 5.0, "cuda_runtime", correlation=12),
            x("sort_kernel", 0, 1080.0, 40.0, "kernel", stream=20, correlation=7),
            x("lookup_kernel", 0, 1250.0, 40.0, "kernel", stream=7, correlation=8),
            x("gemm", 0, 1320.0, 40.0, "kernel", stream=7, correlation=9),
            x("gemm_bwd", 0, 1520.0, 40.0, "kernel", stream=7, correlation=10),
            x("fused_update", 0, 1620.0, 40.0, "kernel", stream=7, correlation=11),
            x("Memcpy HtoD (Pinned -> Device)", 0, 990.0, 20.0, "gpu_memcpy", stream=30, correlation=99),
            x("stray", 0, 1960.0, 10.0, "kernel", stream=7, correlation=12),
            # kineto projects record_function ranges onto the streams: not host phases, not steps.
            x("recaccel-bench/step", 7, 1005.0, 900.0, "gpu_user_annotation"),
            x("recaccel-bench/prepare", 7, 1080.0, 40.0, "gpu_user_annotation"),
        ]
    }


def test_trace_spans_put_kernels_on_their_streams_coloured_by_the_phase_that_launched_them():
    timeline = spans_from_trace(_trace())
    assert timeline.step_starts == [0.0]
    device = {s.name: (s.row, s.kind) for s in timeline.spans if s.row.startswith("CUDA")}
    assert device == {
        "sort_kernel": ("CUDA stream 20", PREPARE),
        "lookup_kernel": ("CUDA stream 7", LOOKUP),
        "gemm": ("CUDA stream 7", FORWARD),
        "gemm_bwd": ("CUDA stream 7", BACKWARD),
        "fused_update": ("CUDA stream 7", SPARSE),
        "Memcpy HtoD (Pinned -> Device)": ("CUDA stream 30", DATA),
        "stray": ("CUDA stream 7", OTHER),
    }
    host = {(s.row, s.kind) for s in timeline.spans if s.row.startswith("CPU")}
    assert ("CPU thread 1 (main)", PREPARE) in host and ("CPU thread 2 (autograd)", SPARSE) in host
    assert {s.row for s in timeline.spans} == {
        "CPU thread 1 (main)",
        "CPU thread 2 (autograd)",
        "CUDA stream 7",
        "CUDA stream 20",
        "CUDA stream 30",
    }
    lookup = next(s for s in timeline.spans if s.name == "lookup_kernel")
    assert (lookup.start_ms, lookup.end_ms) == (0.25, 0.29)


def test_kernel_table_sums_each_kernels_device_time_per_step_largest_first():
    trace = _trace()
    # A second step: gemm launched twice more (40 + 60 us), in the dense forward again.
    trace["traceEvents"] += [
        {"ph": "X", "name": "recaccel-bench/step", "tid": 1, "ts": 2000.0, "dur": 900.0, "cat": "user_annotation", "args": {}},
        {"ph": "X", "name": "gemm", "tid": 0, "ts": 2320.0, "dur": 40.0, "cat": "kernel", "args": {"stream": 7, "correlation": 9}},
        {"ph": "X", "name": "gemm", "tid": 0, "ts": 2400.0, "dur": 60.0, "cat": "kernel", "args": {"stream": 7, "correlation": 9}},
    ]  # fmt: skip
    rows = kernel_table(spans_from_trace(trace), top=3)
    # 330 us of device time in all, gemm 140 of it; the 40 us kernels tie, ranked by name.
    assert rows[0] == {
        "kernel": "gemm",
        "phase": FORWARD,
        "launches_per_step": 1.5,
        "ms_per_step": 0.07,
        "share": round(140 / 330, 4),
        "launched_by": "",  # the trace names no launching op
    }
    assert [(r["kernel"], r["ms_per_step"]) for r in rows[1:]] == [("fused_update", 0.02), ("gemm_bwd", 0.02)]


def test_a_labelled_piece_reads_as_the_piece_and_copies():
    """What asks the labelled piece for more (the graphed head's pooled_buffer) gets the
    piece's own; a copy does not recurse through the forwarding."""

    class Head:
        def __call__(self, x):
            return x + 1

        def pooled_buffer(self):
            return "buffer"

    head = Head()
    labelled = _labelled("dense forward", head)
    assert labelled(1) == 2 and labelled.pooled_buffer() == "buffer"
    assert getattr(labelled, "missing", None) is None
    assert copy.copy(labelled)(2) == 3


def test_a_cpu_timeline_labels_the_trainers_loop_and_leaves_it_as_it_was(tmp_path, tiny):
    device = torch.device("cpu")
    preset = load_preset(str(tiny), device)
    data = make_dataset(preset, rows_needed(32, 4), tmp_path / "data")
    batches = device_batches(data, preset, 2, device)
    (candidate,), _ = recaccel_candidates(
        preset.cfg, preset.schema, device, "recaccel", [Combination("sync", 2)]
    )
    parts = candidate.trainer
    head = parts.objective._head
    timeline = record_timeline(parts, RotatingBatches(batches), device, steps=2, warmup=1)
    assert len(timeline.step_starts) == 2
    kinds = {s.kind for s in timeline.spans}
    assert {
        DATA,
        PREPARE,
        LOOKUP,
        FORWARD,
        BACKWARD,
        SPARSE,
    } <= kinds  # micro-batches: lookup_rows, apply_gradient
    assert "embed" not in vars(parts.objective) and "lookup_rows" not in vars(parts.objective.embedding)
    assert parts.objective._head is head
    with labelled_phases(parts):
        assert parts.objective._head is not head and parts.objective._head._fn is head
    with pytest.raises(ZeroDivisionError):  # labels come off on an error too
        with labelled_phases(parts):
            raise ZeroDivisionError
    assert "prepare" not in vars(parts.objective) and "step" not in vars(parts.optimizer)
