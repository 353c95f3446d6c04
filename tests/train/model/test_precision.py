"""Mixed precision and 16-bit embedding rows end to end: each mode trains to the AUC of fp32.

``train.precision = "bf16"`` (autocast MLPs and interaction) and
``model.embedding_dtype = "bf16" | "fp16"`` (16-bit packed rows, stochastic rounding)
on a small synthetic click dataset: each lands within 0.005 AUC of the same run in
float32. The dataset is large enough for that to be a real bound (the fp32 run reaches
an AUC well above chance and two fp32 runs with different seeds differ by more than the
rounding does); the GPU test runs the same on CUDA through the Triton kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from recaccel.train.loop.trainer import Trainer

pytestmark = pytest.mark.numeric


SMALL = [
    "synth.train_rows=24000",
    "synth.test_rows=8000",
    "synth.num_dense=4",
    "synth.num_sparse=6",
    "synth.cardinality=40",
    "synth.multi_hot_fields=2",
    "synth.max_bag=3",
    "synth.signal_scale=2.0",
    "synth.rows_per_row_group=4000",
    "synth.rows_per_file=12000",
    "data.batch_size=256",
    "data.eval_batch_size=4096",
    "data.shuffle_buffer_rows=4000",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[32, 16, 1]",
    "optim.lr=0.003",
    "optim.sparse_lr=0.05",
    "train.epochs=2",
    "train.log_every=1000",
    "train.progress=false",
]
MODES = {
    "precision_bf16": ["train.precision=bf16"],
    "embedding_bf16": ["model.embedding_dtype=bf16"],
    "embedding_fp16": ["model.embedding_dtype=fp16"],
}
AUC_TOLERANCE = 0.005


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("precision_synth")
    generate_synthetic(load_config(None, [*SMALL, f'synth.out_dir="{root}"']).synth)
    return root


def _train(data: Path, out: Path, *extra: str) -> dict:
    cfg = load_config(
        None,
        [
            *SMALL,
            f'data.train="{data / "train"}"',
            f'data.test="{data / "test"}"',
            f'train.out_dir="{out}"',
            *extra,
        ],
    )
    return Trainer(cfg).fit()


@pytest.fixture(scope="module")
def fp32_cpu(small_data, tmp_path_factory) -> dict:
    return _train(small_data, tmp_path_factory.mktemp("fp32"), "train.device=cpu")


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_lands_within_auc_tolerance_of_fp32(small_data, fp32_cpu, tmp_path, mode):
    metrics = _train(small_data, tmp_path / mode, "train.device=cpu", *MODES[mode])
    assert fp32_cpu["auc"] > 0.7, "fp32 must learn the planted signal for the bound to mean anything"
    assert metrics["auc"] != fp32_cpu["auc"], "the mode must change the arithmetic"
    assert abs(metrics["auc"] - fp32_cpu["auc"]) < AUC_TOLERANCE, (mode, metrics["auc"], fp32_cpu["auc"])
    assert abs(metrics["logloss"] - fp32_cpu["logloss"]) < 0.01


def test_embedding_dtype_is_stored_and_resumes(small_data, tmp_path):
    """16-bit rows are saved in their dtype with the rounding generator; resuming from the
    checkpoint of step 20 ends exactly where the uninterrupted run ends."""
    extra = ["train.device=cpu", "model.embedding_dtype=bf16", "train.steps=40", "train.epochs=1"]
    full = _train(small_data, tmp_path / "full", *extra)
    _train(small_data, tmp_path / "part", *extra[:-2], "train.steps=20", "train.epochs=1")
    cfg = load_config(tmp_path / "part" / "config.toml", ["train.steps=40", "train.epochs=1"])
    resumed = Trainer(cfg, resume=True).fit()
    assert resumed["auc"] == full["auc"] and resumed["logloss"] == full["logloss"]
    assert json.loads((tmp_path / "full" / "metrics.json").read_text())["steps"] == 40
    saved = torch.load(sorted((tmp_path / "full").glob("**/*.pt"))[-1], weights_only=True)["model"]
    rows = [v for k, v in saved.items() if k.endswith(".weight") and "embedding" in k]
    assert rows and all(v.dtype == torch.bfloat16 for v in rows)
    assert any(k.endswith("rounding_generator") for k in saved)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_lands_within_auc_tolerance_of_fp32_on_cuda(small_data, tmp_path, mode):
    """The same on CUDA: auto backends (Triton embedding and interaction), bf16 autocast."""
    assert torch.cuda.is_available()
    base = _train(small_data, tmp_path / "fp32", "train.device=cuda")
    metrics = _train(small_data, tmp_path / mode, "train.device=cuda", *MODES[mode])
    assert base["auc"] > 0.7
    assert abs(metrics["auc"] - base["auc"]) < AUC_TOLERANCE, (mode, metrics["auc"], base["auc"])


def test_bf16_autocast_keeps_pooled_rows_and_logits_float32():
    """Under autocast the hidden layers run in bf16 but the logit layer does not: bf16
    logits (8 significant bits) would tie rows and cost AUC (measured on the debug preset).

    Rows can still tie when their bf16 hidden activations are equal (all ReLUs off gives the
    bias), so the check is what the logit layer computes, not that every logit is distinct.
    """
    from recaccel.models.arches import OverArch

    torch.manual_seed(0)  # the layers' initial weights
    arch = OverArch(8, [16, 1])
    x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = arch(x)
        hidden = arch.model[:-1](x)
    assert hidden.dtype == torch.bfloat16, "the hidden layers must run in bf16 for the check to mean anything"
    assert logits.dtype == torch.float32
    assert arch.model[0].weight.dtype == torch.float32
    logit_layer = arch.model[-1]
    expected = torch.nn.functional.linear(hidden.float(), logit_layer.weight, logit_layer.bias).squeeze(-1)
    torch.testing.assert_close(logits, expected)
    # A bf16 logit layer would round every logit to 8 significant bits, then cast back.
    assert (logits.bfloat16().float() != logits).float().mean() > 0.9
