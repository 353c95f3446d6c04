"""The MLPerf-shaped DLRM-DCNv2 presets: their shape, and the CPU one trains from the CLI."""

from __future__ import annotations

import json

from recaccel.cli import data_main, train_main
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
