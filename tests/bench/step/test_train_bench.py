"""``recaccel-bench train``: every candidate through the CLI on a tiny preset, the JSON it
writes, the equivalence check that guards it, the presets' sizes."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from recaccel.bench.step import eager as train_eager
from recaccel.bench.step.candidates import CANDIDATES, PHASES
from recaccel.bench.step.data import CPU_TABLE_BYTES, load_preset
from recaccel.cli import bench_main


def _argv(tmp_path, preset, *extra):
    return [
        "train",
        "--preset",
        str(preset),
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
        "--compile-backend",
        "aot_eager",  # dynamo + AOT autograd without inductor's C++ build: seconds, not a minute
        "--out",
        str(tmp_path / "train.md"),
        "--json",
        str(tmp_path / "train.json"),
        *extra,
    ]


def test_every_candidate_in_both_modes_writes_the_json_schema(tmp_path, tiny):
    assert bench_main(_argv(tmp_path, tiny, "--plot", str(tmp_path / "train.png"))) == 0
    out = json.loads((tmp_path / "train.json").read_text())
    assert {"device", "torch", "date", "git_commit"} <= set(out["env"])
    rows = out["results"]
    assert sorted((r["candidate"], r["mode"]) for r in rows) == sorted(
        (c, m) for c in CANDIDATES for m in ("device", "reader")
    )
    for r in rows:
        assert {"candidate", "preset", "device", "batch", "mode", "samples_per_s", "step_ms"} <= set(r)
        assert {"phases_ms", "speedup_vs_eager"} <= set(r)
        assert (r["preset"], r["device"], r["batch"]) == ("tiny", "cpu", 32)
        if r["candidate"] == "compiled" and r["status"] == "skipped":
            assert r["reason"].startswith("torch.compile failed")
            continue
        assert r["status"] == "ok", r
        assert r["samples_per_s"] == pytest.approx(32 / (r["step_ms"] * 1e-3))
        assert set(r["phases_ms"]) == set(PHASES)
        for phase in ("embedding_forward", "mlps", "backward", "dense_optimizer"):
            assert r["phases_ms"][phase] > 0, (r["candidate"], phase)
        data_wait = r["phases_ms"]["data_wait"]
        if r["mode"] == "reader":
            assert isinstance(data_wait, float) and 0 <= r["data_wait_fraction"] < 1
            assert r["reader_workers"] == 0  # data.workers = auto decodes in-process on a CPU device
        else:
            assert data_wait.startswith("none") and r["data_wait_fraction"] is None
            assert "reader_workers" not in r
        if r["candidate"] == "eager":
            assert r["speedup_vs_eager"] == 1.0
        else:
            assert r["speedup_vs_eager"] > 0
    by = {(r["candidate"], r["mode"]): r for r in rows}
    for name in ("recaccel", "reference"):  # the fused update timed apart from the dense backward
        assert by[name, "device"]["phases_ms"]["sparse_update"] > 0
        assert by[name, "device"]["dense_head_TFLOPs"] > 0
    assert "dense_head_TFLOPs" not in by["eager", "device"]  # its backward holds the tables' too
    assert by["eager", "device"]["phases_ms"]["sparse_update"] > 0
    text = (tmp_path / "train.md").read_text()
    assert "eager computes recaccel's function" in text and "torch.optim.Adagrad" in text
    assert (tmp_path / "train.png").stat().st_size > 0


def test_an_eager_model_computing_another_function_stops_the_benchmark(tmp_path, tiny, monkeypatch, capsys):
    def lower_triangle(self, dense, pooled):  # the pairs in another order: another function
        x = torch.cat([dense.unsqueeze(1), pooled], dim=1)
        i, j = torch.tril_indices(x.shape[1], x.shape[1], offset=-1)
        return torch.cat([dense, torch.bmm(x, x.transpose(1, 2))[:, i, j]], dim=1)

    monkeypatch.setattr(train_eager.EagerHead, "interact", lower_triangle)
    assert bench_main(_argv(tmp_path, tiny, "--mode", "device", "--plot", "")) == 2
    err = capsys.readouterr().err
    assert "the eager baseline does not compute recaccel's function" in err
    assert not (tmp_path / "train.json").exists()  # nothing was timed


def test_compiled_is_reported_skipped_where_torch_compile_fails(tmp_path, tiny, monkeypatch):
    def no_compiler(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

        return fail

    monkeypatch.setattr(torch, "compile", no_compiler)
    argv = _argv(tmp_path, tiny, "--mode", "device", "--candidates", "eager", "compiled", "--plot", "")
    assert bench_main(argv) == 0
    rows = {r["candidate"]: r for r in json.loads((tmp_path / "train.json").read_text())["results"]}
    assert rows["eager"]["status"] == "ok"
    assert rows["compiled"]["status"] == "skipped" and rows["compiled"]["samples_per_s"] is None
    assert rows["compiled"]["reason"] == (
        "torch.compile failed: RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    )
    assert "compiled (skipped)" in (tmp_path / "train.md").read_text()


def test_an_unknown_preset_is_one_line(tmp_path, capsys):
    assert bench_main(_argv(tmp_path, "bench_nope", "--plot", "")) == 2
    err = capsys.readouterr().err.strip()
    assert "preset 'bench_nope'" in err and "bench_criteo_1hot" in err and len(err.splitlines()) == 1


def test_presets_run_as_written_on_a_gpu_and_scaled_down_on_cpu():
    criteo = load_preset("bench_criteo_1hot", torch.device("cuda"))
    assert criteo.scaled == () and criteo.batch_size == 65536
    assert criteo.schema.num_sparse == 26 and not any(f.multi_hot for f in criteo.schema.sparse)
    model = criteo.cfg.model
    assert (model.embedding_dim, model.bottom_mlp, model.top_mlp) == (
        128,
        [512, 256, 128],
        [1024, 1024, 512, 256, 1],
    )
    assert max(criteo.schema.cardinalities) == 2_000_000
    wide = load_preset("bench_wide", torch.device("cuda"))
    assert wide.schema.num_sparse == 500 and wide.cfg.model.embedding_dim == 32 and wide.scaled == ()

    small = load_preset("bench_criteo_1hot", torch.device("cpu"))
    cap = CPU_TABLE_BYTES // (26 * 128 * 4)
    assert small.batch_size == 1024 and max(small.schema.cardinalities) == cap
    assert small.scaled[0] == "batch 65536 -> 1024" and f"capped at {cap} rows" in small.scaled[1]
    forced = load_preset("bench_wide", torch.device("cpu"), batch=100, cardinality_cap=7)
    assert forced.batch_size == 100 and max(forced.schema.cardinalities) == 7


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("preset_rows", [64 * 32, 64 * 32 * 16])
def test_reader_mode_resolves_auto_workers_as_the_trainer_does(
    tmp_path, tiny, device, preset_rows, monkeypatch
):
    """On a GPU host the trainer reads with reader processes; the benchmark's reader path
    must time that input path, not the in-process decoder (session 12's H200 data cost):
    resolved for the preset's dataset (``synth.train_rows``), of which the benchmark reads
    a cut of 8 shuffle buffers here (session 15's bench_wide: a cut of 2 buffers gave none)."""
    from recaccel.bench.step import data as bench_data
    from recaccel.io.format.dataset import open_dataset
    from recaccel.io.readers.options import auto_workers

    preset = load_preset(str(tiny), torch.device("cpu"))
    data_cfg = dataclasses.replace(preset.cfg.data, shuffle_buffer_rows=256)
    synth = dataclasses.replace(preset.cfg.synth, train_rows=preset_rows)
    preset = dataclasses.replace(preset, cfg=dataclasses.replace(preset.cfg, data=data_cfg, synth=synth))
    path = bench_data.make_dataset(preset, 64 * 32 if preset_rows == 64 * 32 else 512, tmp_path / "data")
    buffers = -(-max(open_dataset(path).num_rows, preset_rows) // preset.cfg.data.shuffle_buffer_rows)
    made = {}

    class Loader:  # the DeviceLoader of a CUDA device cannot be built on a CPU host
        def __init__(self, reader, *args, **kwargs):
            made["workers"] = reader.options.workers

        def iter_with_state(self):
            return iter(())

    monkeypatch.setattr(bench_data, "DeviceLoader", Loader)
    source = bench_data.ReaderBatches(path, preset, torch.device(device))
    expected = auto_workers("auto", device, 1, buffers)
    assert preset.cfg.data.workers == "auto" and source.workers == made["workers"] == expected
    assert buffers >= 8  # the cut of 512 rows alone is 2 buffers, too few for workers
    if device == "cuda" and len(os.sched_getaffinity(0)) >= 2:
        assert source.workers > 0
