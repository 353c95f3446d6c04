"""DCN-v2 interaction arch: against TorchRec's LowRankCrossNet, in the factory, trained from the CLI,
and meta-learned (its cross layers shared by every task)."""

from __future__ import annotations

import json

import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import ModelConfig, OptimConfig, load_config
from recaccel.errors import ConfigError
from recaccel.io.convert.synth import generate_synthetic
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.meta.heads import adapt_plan
from recaccel.meta.learner import MetaLearner
from recaccel.models import build_model
from recaccel.models.arches import DCNv2InteractionArch
from recaccel.sparse import Batch, SparseFeatures, TaskBatch

pytestmark = pytest.mark.numeric


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
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    'model.interaction="dcnv2"',
    "model.dcn_layers=2",
    "model.dcn_rank=8",
    "train.log_every=50",
    "train.progress=false",
]


def test_arch_matches_torchrec_low_rank_cross_net():
    """Same weights in TorchRec's DLRM_DCN cross net give the same output (an outside check of the spec)."""
    from torchrec.models.dlrm import InteractionDCNArch
    from torchrec.modules.crossnet import LowRankCrossNet

    f, d, layers, rank = 3, 4, 2, 5
    arch = DCNv2InteractionArch(f, d, layers, rank, backend="reference").double()
    with torch.no_grad():
        arch.b.normal_()
    theirs = InteractionDCNArch(f, LowRankCrossNet(d * (f + 1), layers, rank)).double()
    with torch.no_grad():
        for layer in range(layers):
            theirs.crossnet.W_kernels[layer].copy_(arch.u[layer])
            theirs.crossnet.V_kernels[layer].copy_(arch.v[layer])
            theirs.crossnet.bias[layer].copy_(arch.b[layer])
    dense, pooled = torch.randn(6, d, dtype=torch.float64), torch.randn(6, f, d, dtype=torch.float64)
    out = arch(dense, pooled)
    assert out.shape == (6, arch.output_dim) == (6, d * (f + 1))
    torch.testing.assert_close(out, theirs(dense, pooled))


def test_arch_initialisation_and_bf16_autocast():
    arch = DCNv2InteractionArch(26, 16, 3, 64)
    assert arch.u.shape == (3, 432, 64) and arch.v.shape == (3, 64, 432) and not arch.b.any()
    assert "layers=3, rank=64" in repr(arch)
    dense, pooled = torch.randn(4, 16), torch.randn(4, 26, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = arch(dense, pooled)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), arch(dense, pooled), rtol=0.05, atol=0.05)


def _schema() -> FeatureSchema:
    return FeatureSchema(dense=("d0", "d1"), sparse=(SparseField("a", 20), SparseField("b", 30)))


def test_factory_builds_dcn_variant_and_trains_its_weights():
    cfg = ModelConfig(
        embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction="dcnv2", dcn_layers=2, dcn_rank=3
    )
    model = build_model(cfg, OptimConfig(), _schema(), torch.device("cpu"))
    assert isinstance(model.interaction_arch, DCNv2InteractionArch)
    assert model.interaction_arch.u.shape == (2, 12, 3)
    assert model.over_arch.model[0].in_features == 12
    sparse = SparseFeatures.from_lengths(
        ["a", "b"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 1, 1])
    )
    logits = model(Batch(dense=torch.randn(2, 2), sparse=sparse, labels=torch.zeros(2)))
    logits.sum().backward()
    assert logits.shape == (2,) and model.interaction_arch.u.grad.abs().sum() > 0
    dot = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4]), OptimConfig(), _schema(), "cpu")
    assert not any(True for _ in dot.interaction_arch.parameters())


def test_cli_trains_tiny_dcn_that_learns(tmp_path, capsys):
    data = tmp_path / "data"
    report = generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{data}"']).synth)
    sets = [*TINY, f'data.train="{data / "train"}"', f'data.test="{data / "test"}"']
    sets += [f'train.out_dir="{tmp_path / "run"}"', "train.epochs=3"]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["steps"] == 3 * (6000 // 256)
    # Learns most of what the planted model allows (a constant scores 0.5).
    assert report.bayes_auc - 0.08 < metrics["auc"] <= report.bayes_auc + 0.02
    assert "bayes" not in capsys.readouterr().err


def test_bad_interaction_is_one_line_config_error():
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[4])
    object.__setattr__(cfg, "interaction", "cin")
    with pytest.raises(ConfigError, match="model.interaction"):
        build_model(cfg, OptimConfig(), _schema(), torch.device("cpu"))


def _task_batch(t: int, s: int, q: int, gen: torch.Generator) -> TaskBatch:
    def rows(n: int) -> Batch:
        sparse = SparseFeatures.from_lengths(
            ["a", "b"], torch.randint(0, 20, (2 * n,), generator=gen), torch.ones(2 * n, dtype=torch.int64)
        )
        return Batch(
            dense=torch.randn(n, 2, generator=gen), sparse=sparse, labels=torch.rand(n, generator=gen)
        )

    return TaskBatch(
        support=rows(t * s),
        query=rows(t * q),
        support_mask=torch.ones(t, s),
        query_mask=torch.ones(t, q),
        task_ids=torch.arange(t),
    )


@pytest.mark.parametrize("adapt", ["top_mlp", "head", "head_and_embedding_shift"])
def test_meta_engines_train_the_shared_cross_layers(adapt):
    from recaccel.config import MetaConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        embedding_dim=4,
        bottom_mlp=[8, 4],
        top_mlp=[8, 1],
        interaction="dcnv2",
        dcn_layers=2,
        dcn_rank=3,
        embedding_backend="reference",
    )
    model = build_model(cfg, OptimConfig(), _schema(), torch.device("cpu"))
    plan = adapt_plan(model, adapt)
    assert not any(n.startswith("interaction_arch") for n in plan.names)  # shared, never adapted
    tb = _task_batch(3, 4, 5, torch.Generator().manual_seed(1))
    meta = MetaConfig(inner_steps=2, inner_lr=0.1, adapt=adapt, first_order=False)
    for engine in ("batched", "vmap", "loop"):
        model.zero_grad()
        loss, _ = MetaLearner(model, meta, loss="bce", engine=engine).step_loss(tb)
        loss.backward()  # second order through the inner loop
        for p in (model.interaction_arch.u, model.interaction_arch.v, model.interaction_arch.b):
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, engine


def test_factory_passes_model_dcn_kernel_and_the_arch_refuses_an_unknown_one():
    schema = _schema()
    for kernel in ("gemm", "fused"):
        cfg = ModelConfig(
            embedding_dim=4,
            bottom_mlp=[8, 4],
            top_mlp=[8, 1],
            interaction="dcnv2",
            dcn_layers=1,
            dcn_kernel=kernel,
        )
        model = build_model(cfg, OptimConfig(), schema, torch.device("cpu"))
        assert model.interaction_arch.kernel == kernel and f"kernel={kernel!r}" in repr(
            model.interaction_arch
        )
    with pytest.raises(ConfigError, match="model.dcn_kernel must be one of gemm, fused, got 'cutlass'"):
        DCNv2InteractionArch(2, 4, 1, 3, kernel="cutlass")
