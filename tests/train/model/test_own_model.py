"""One's own model through the API (recaccel.train(cfg, model=...)): the contract is
checked up front, it trains, checkpoints, resumes exactly and evaluates; the example of
docs/own_model.md runs as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import recaccel
from recaccel.api import run_config
from recaccel.config import load_config
from recaccel.errors import ConfigError, RecaccelError
from recaccel.models import DLRM, SparseArch, build_embedding, build_model
from recaccel.train.checkpoint.state import list_checkpoints
from recaccel.train.model.user_model import check_user_model
from tests.helpers.dlrm_run import overrides

DOC = Path(__file__).resolve().parents[3] / "docs" / "own_model.md"


class Bilinear(nn.Module):
    """Pooled field embeddings summed, dotted with a projection of the dense features."""

    def __init__(self, cfg, schema, device):
        super().__init__()
        self.sparse_arch = SparseArch(build_embedding(cfg.model, cfg.optim, schema, device))
        self.dense = nn.Linear(schema.num_dense, cfg.model.embedding_dim)
        self.bias = nn.Parameter(torch.zeros(()))

    def prepare_sparse(self, sparse):
        return self.sparse_arch.prepare(sparse)

    def embed(self, sparse):
        return self.sparse_arch(sparse)

    def head(self, dense, pooled):
        return (self.dense(dense) * pooled.sum(1)).sum(1) + self.bias


class NoHead(nn.Module):
    def embed(self, sparse):
        return sparse

    def prepare_sparse(self, sparse):
        return sparse


def test_the_contract_is_checked_in_one_line():
    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match=r"^model NoHead has no head: a model needs embed\(sparse\)"):
        check_user_model(NoHead(), cfg)
    with pytest.raises(ConfigError, match="has no embed, head, prepare_sparse"):
        check_user_model(nn.Linear(2, 2), cfg)
    micro = load_config(None, ["train.micro_batches=2"])
    with pytest.raises(ConfigError, match="train.micro_batches=2 updates the model's sparse_arch.embedding"):
        check_user_model(_with_head(NoHead()), micro)
    for sets, key in (
        (["train.mode=meta"], "train.mode=meta"),
        (["train.eval_tasks=true"], "train.eval_tasks=true"),
    ):
        with pytest.raises(
            ConfigError, match=f"{key} adapts .* has no sparse_arch, dense_arch, interaction_arch"
        ):
            check_user_model(_with_head(NoHead()), load_config(None, sets))


def _with_head(module: nn.Module) -> nn.Module:
    module.head = lambda dense, pooled: pooled.sum((1, 2))
    return module


def test_a_recaccel_dlrm_meets_every_setting(tiny_data):  # noqa: F811
    from recaccel.io.format.dataset import open_dataset

    cfg = load_config(None, ["train.mode=meta", "train.micro_batches=1"])
    schema = open_dataset(tiny_data / "train").schema
    model = build_model(cfg.model, cfg.optim, schema, torch.device("cpu"))
    assert isinstance(model, DLRM)
    check_user_model(model, cfg)
    check_user_model(model, load_config(None, ["train.micro_batches=2"]))


def test_bad_model_arguments_are_refused_before_training(tiny_data, tmp_path):  # noqa: F811
    cfg = load_config(None, overrides(tiny_data, tmp_path / "run", "train.steps=2"))
    with pytest.raises(ConfigError, match="model NoHead has no head"):
        recaccel.train(cfg, model=NoHead())
    with pytest.raises(ConfigError, match="must be an nn.Module or a callable"):
        recaccel.train(cfg, model=3)
    with pytest.raises(ConfigError, match="callable returned a str, not an nn.Module"):
        recaccel.train(cfg, model=lambda schema, device: "model")
    assert not list_checkpoints(tmp_path / "run")


def test_own_model_trains_resumes_exactly_and_evaluates(tiny_data, tmp_path):  # noqa: F811
    seen = []

    def build(schema, device):
        seen.append((schema.sparse_names, device))
        return Bilinear(cfg, schema, device)

    full, part = tmp_path / "full", tmp_path / "part"
    cfg = load_config(None, overrides(tiny_data, full, "train.steps=14", "train.epochs=2"))
    metrics = recaccel.train(cfg, model=build)
    assert seen and seen[0][1] == torch.device("cpu") and len(seen[0][0]) == 4
    assert metrics["steps"] == 14 and 0.5 < metrics["auc"] <= 1.0  # it learned something

    short = load_config(None, overrides(tiny_data, part, "train.steps=6", "train.epochs=2"))
    recaccel.train(short, model=build)
    resumed = recaccel.resume(part, ["train.steps=14"], model=build)
    a = torch.load(list_checkpoints(full)[-1], weights_only=True)
    b = torch.load(list_checkpoints(part)[-1], weights_only=True)
    assert set(a["model"]) == set(b["model"]) and any(k.startswith("dense.") for k in a["model"])
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert resumed["auc"] == metrics["auc"]

    scored = recaccel.evaluate(run_config(full), model=build)
    assert scored["auc"] == pytest.approx(metrics["auc"], abs=1e-6)
    with pytest.raises(RecaccelError, match="entry 'model' lacks key 'dense_arch"):
        recaccel.evaluate(run_config(full))  # recaccel's DLRM does not load the other's state


def test_a_module_instance_trains_too(tiny_data, tmp_path):  # noqa: F811
    from recaccel.io.format.dataset import open_dataset

    cfg = load_config(None, overrides(tiny_data, tmp_path / "run", "train.steps=3"))
    schema = open_dataset(cfg.data.train).schema
    model = Bilinear(cfg, schema, torch.device("cpu"))
    before = model.dense.weight.detach().clone()
    assert recaccel.train(cfg, model=model)["steps"] == 3
    assert not torch.equal(before, model.dense.weight)  # the very module was trained


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], str(DOC), "exec"), {"__name__": "own_model_example"})
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["after 20 steps", "after 40 steps"]
    metrics = json.loads((tmp_path / "runs" / "own_model" / "metrics.json").read_text())
    assert metrics["steps"] == 40 and metrics["auc"] > 0.5
