"""The MLPerf-shaped DLRM-DCNv2 presets: their shape, and the CPU one trains from the CLI."""

from __future__ import annotations

import json

from recaccel.cli import bench_main, data_main, train_main
from recaccel.config import load_config

MLPERF_BAGS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def test_mlperf_preset_has_mlperf_shape(repo_root):
    cfg = load_config(repo_root / "configs" / "dlrm_dcnv2_mlperf.toml", [])
    m = cfg.model
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (m.interaction, m.dcn_layers, m.dcn_rank) == ("dcnv2", 3, 512)
    assert cfg.optim.sparse == "rowwise_adagrad"
    assert (cfg.synth.num_dense, cfg.synth.num_sparse, cfg.synth.multi_hot_fields) == (13, 26, 26)
    assert max(cfg.synth.cardinalities) == 4_000_000  # MLPerf's 40 M-row tables, capped
    assert list(cfg.synth.bag_sizes) == list(MLPERF_BAGS)  # each field's fixed bag size
    cpu = load_config(repo_root / "configs" / "dlrm_dcnv2_mlperf_cpu.toml", [])
    assert list(cpu.synth.bag_sizes) == list(MLPERF_BAGS)


def test_cpu_preset_trains_a_few_steps(repo_root, tmp_path, capsys):
    preset = str(repo_root / "configs" / "dlrm_dcnv2_mlperf_cpu.toml")
    small = ["synth.train_rows=2048", "synth.test_rows=512", f'synth.out_dir="{tmp_path / "data"}"']
    run = [
        f'data.train="{tmp_path / "data" / "train"}"',
        f'data.test="{tmp_path / "data" / "test"}"',
        f'train.out_dir="{tmp_path / "run"}"',
        "train.steps=4",
        "train.progress=false",
    ]
    assert data_main(["synth", "--config", preset, *[a for s in small for a in ("--set", s)]]) == 0
    assert train_main(["--config", preset, *[a for s in run for a in ("--set", s)]]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 4 and 0.0 <= metrics["auc"] <= 1.0
    assert load_config(preset, []).model.interaction == "dcnv2"


def test_bench_preset_has_mlperf_dcnv2_shape_and_batch_per_gpu(repo_root):
    cfg = load_config(repo_root / "configs" / "bench_dcnv2_mlperf.toml", [])
    m = cfg.model
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (m.interaction, m.dcn_layers, m.dcn_rank, m.dcn_kernel) == ("dcnv2", 3, 512, "gemm")
    assert (cfg.synth.num_dense, cfg.synth.num_sparse, cfg.synth.multi_hot_fields) == (13, 26, 26)
    assert list(cfg.synth.bag_sizes) == list(MLPERF_BAGS)
    assert cfg.data.batch_size * 8 == 55_296  # MLPerf's global batch over 8 GPUs


def test_bench_preset_runs_in_the_train_benchmark_on_cpu(tmp_path):
    """Tiny CPU mode: the eager baseline proves it computes the DCN-v2 model's function, then
    eager and recaccel train a few timed steps."""
    argv = ["train", "--preset", "bench_dcnv2_mlperf", "--device", "cpu", "--batch", "16"]
    argv += ["--cardinality-cap", "64", "--mode", "device", "--candidates", "eager", "recaccel"]
    argv += ["--steps", "1", "--warmup", "1", "--phase-steps", "1", "--rotate", "1", "--plot", ""]
    argv += ["--out", str(tmp_path / "train.md"), "--json", str(tmp_path / "train.json")]
    assert bench_main(argv) == 0
    rows = json.loads((tmp_path / "train.json").read_text())["results"]
    assert {r["candidate"] for r in rows} >= {"eager", "recaccel"}
    assert all(r["status"] == "ok" and r["preset"] == "bench_dcnv2_mlperf" for r in rows)
    assert "eager computes recaccel's function" in (tmp_path / "train.md").read_text()
