"""Tiny CLI runs the export and run-output tests train, and exporting one."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from recaccel.cli import export_main, train_main
from recaccel.config import load_config
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.rows import BatchReader
from recaccel.sparse import SparseFeatures

EXPORT_TINY = [
    "synth.train_rows=600",
    "synth.test_rows=200",
    "synth.num_dense=2",
    "synth.num_sparse=3",
    "synth.cardinality=30",
    "synth.multi_hot_fields=1",
    "synth.rows_per_row_group=300",
    "data.batch_size=64",
    "data.shuffle_buffer_rows=200",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8, 4]",
    "model.top_mlp=[8, 1]",
    "train.log_every=2",
    "train.progress=false",
    "train.steps=4",
    "train.checkpoint_every=2",
]


def train_run(data: Path, out: Path, *extra: str) -> Path:
    """A 4-step CLI run on ``data`` with checkpoints at steps 2 and 4."""
    sets = [
        *EXPORT_TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    return out


def data_batches(run: Path, batch_size: int = 64) -> list:
    """The run's test rows, in order, in batches (the last one short)."""
    cfg = load_config(run / "config.toml")
    return list(BatchReader(cfg.data.test, batch_size, ReadOptions(shuffle=False, drop_last=False)))


def random_sparse(fields: list[tuple[str, int]], batch: int, seed: int) -> SparseFeatures:
    """Bags of 0..3 ids (empty bags and repeated ids included) for every field."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(fields) * batch,), generator=g)
    values = [
        torch.randint(0, rows, (int(lengths[f * batch : (f + 1) * batch].sum()),), generator=g)
        for f, (_, rows) in enumerate(fields)
    ]
    return SparseFeatures.from_lengths([n for n, _ in fields], torch.cat(values), lengths)


def export(run: Path, fmt: str, out: Path, *extra: str) -> dict:
    assert export_main([str(run), str(out), "--format", fmt, *extra]) == 0
    return json.loads(out.with_suffix(".json").read_text())
