"""Tiny CLI runs the export tests share (trained once per test session of this folder):
dot and DCN-v2 DLRMs on synthetic click data, MeLU, and a meta-DLRM on ratings."""

from __future__ import annotations

from pathlib import Path

import pytest

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from tests.train.test_meta_trainer import _argv as meta_argv
from tests.train.test_meta_trainer import _ratings

TINY = [
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
DCN = ["model.interaction=dcnv2", "model.dcn_layers=2", "model.dcn_rank=3", "model.pooling=mean"]


def train_run(data: Path, out: Path, *extra: str) -> Path:
    """A 4-step CLI run on ``data`` with checkpoints at steps 2 and 4."""
    sets = [
        *TINY,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    return out


@pytest.fixture(scope="package")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synth")
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{root}"']).synth)
    return root


@pytest.fixture(scope="package")
def dot_run(tiny_data, tmp_path_factory) -> Path:
    return train_run(tiny_data, tmp_path_factory.mktemp("dot") / "run", "optim.sparse=adam")


@pytest.fixture(scope="package")
def dcn_run(tiny_data, tmp_path_factory) -> Path:
    extra = (
        "optim.sparse=rowwise_adagrad",
        "model.embedding_backend=reference",
        "model.embedding_dtype=bf16",
    )
    return train_run(tiny_data, tmp_path_factory.mktemp("dcn") / "run", *DCN, *extra)


@pytest.fixture(scope="package")
def melu_run(tiny_data, tmp_path_factory) -> Path:
    extra = ("model.arch=melu", 'model.item_fields=["C1"]', "model.pooling=mean", "model.top_mlp=[8, 8, 1]")
    return train_run(tiny_data, tmp_path_factory.mktemp("melu") / "run", *extra)


@pytest.fixture(scope="package")
def meta_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tasks")
    train, test = _ratings(root / "train", range(0, 48), 0), _ratings(root / "test", range(48, 64), 1)
    out = tmp_path_factory.mktemp("meta") / "run"
    assert (
        train_main(meta_argv(train, test, out, "train.mode=meta", "train.steps=2", "meta.meta_sgd=true")) == 0
    )
    return out
