"""The --set arguments of small hybrid (multi-process) runs and a free local port."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.helpers.dlrm_run import TINY as TINY_DLRM

WORLD = 2
STEPS = 12  # an epoch is 23 steps: runs and the resume point are mid-epoch


SHARDED_TINY = [*TINY_DLRM, "optim.sparse=rowwise_adagrad"]


def sharded_overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        *SHARDED_TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        f"train.steps={STEPS}",
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HYBRID_TINY = [
    "synth.train_rows=3000",
    "synth.test_rows=1000",
    "synth.num_dense=3",
    "synth.num_sparse=3",
    "synth.cardinality=40",
    "synth.multi_hot_fields=1",
    "synth.rows_per_row_group=500",
    "synth.rows_per_file=1500",
    "data.batch_size=128",
    "data.shuffle_buffer_rows=1000",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.progress=false",
    "train.log_every=4",
    "optim.sparse=rowwise_adagrad",
]


def hybrid_set_args(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        *HYBRID_TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]
    return [arg for s in sets for arg in ("--set", s)]
