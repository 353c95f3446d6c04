"""Tiny CLI runs the export tests share (trained once per test session of this folder):
dot and DCN-v2 DLRMs on synthetic click data, MeLU, and a meta-DLRM on ratings."""

from __future__ import annotations

from pathlib import Path

import pytest

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from tests.helpers.export_run import EXPORT_TINY, train_run
from tests.helpers.meta_run import meta_set_args, write_ratings

DCN = ["model.interaction=dcnv2", "model.dcn_layers=2", "model.dcn_rank=3", "model.pooling=mean"]


@pytest.fixture(scope="package")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synth")
    generate_synthetic(load_config(None, [*EXPORT_TINY, f'synth.out_dir="{root}"']).synth)
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
    train, test = (
        write_ratings(root / "train", range(0, 48), 0),
        write_ratings(root / "test", range(48, 64), 1),
    )
    out = tmp_path_factory.mktemp("meta") / "run"
    assert (
        train_main(meta_set_args(train, test, out, "train.mode=meta", "train.steps=2", "meta.meta_sgd=true"))
        == 0
    )
    return out
