"""The tiny DLRM run of the trainer tests: its --set overrides and its final state."""

from __future__ import annotations

from pathlib import Path

import torch

from recaccel.train.checkpoint.state import list_checkpoints

TINY = [
    "synth.train_rows=6000",
    "synth.test_rows=2000",
    "synth.num_dense=3",
    "synth.num_sparse=4",
    "synth.cardinality=50",
    "synth.multi_hot_fields=1",
    "synth.rows_per_row_group=1000",
    "synth.rows_per_file=3000",
    "data.batch_size=256",
    "data.shuffle_buffer_rows=2000",
    "data.prefetch=2",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.log_every=5",
    "train.progress=false",
]


def overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]


def set_args(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(list_checkpoints(run_dir)[-1], weights_only=True)
