"""What the model wires in on CUDA, checked on CPU: the dot interaction's padded output row
(``model.interaction_pad``) changes neither the model's math nor its parameters."""

from __future__ import annotations

import pytest
import torch

from recaccel.config import MetaConfig, ModelConfig, OptimConfig
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.meta import MetaLearner
from recaccel.models import build_model
from recaccel.models.arches import DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import PerTableEmbeddingBag
from recaccel.models.factory import interaction_pads

# F = 3 fields of D = 4: the interaction row is 4 + 6 = 10 wide, padded to 16.
FIELDS, DIM, BATCH = 3, 4, 9
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _schema() -> FeatureSchema:
    return FeatureSchema(
        dense=("d0", "d1", "d2"), sparse=tuple(SparseField(f"f{i}", 20 + i) for i in range(FIELDS))
    )


def _model(pad: str, backend: str = "reference", top_mlp: tuple[int, ...] = (12, 5, 1)) -> DLRM:
    cfg = ModelConfig(
        embedding_dim=DIM,
        bottom_mlp=[6, DIM],
        top_mlp=list(top_mlp),
        interaction_backend=backend,
        interaction_pad=pad,
    )
    torch.manual_seed(0)
    return build_model(cfg, OptimConfig(sparse="sgd"), _schema(), torch.device("cpu"))


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, generator=gen), torch.randn(BATCH, FIELDS, DIM, generator=gen)


def _head_and_grads(model: DLRM, dense: torch.Tensor, pooled: torch.Tensor):
    """Logits of the dense head and the gradients of a loss on them: every parameter's
    and the pooled embeddings' (what the sparse update would apply)."""
    pooled = pooled.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    logits = model.head(dense, pooled)
    labels = (torch.arange(BATCH) % 2).float()
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), pooled.grad, grads


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_interaction_gives_the_unpadded_logits_and_gradients(backend):
    off, on = _model("off", backend), _model("on", backend)
    on.load_state_dict(off.state_dict())
    assert on.interaction_arch.pad and on.over_arch.padded_input and not off.interaction_arch.pad
    dense, pooled = _inputs(1)
    hidden = on.dense_arch(dense)
    row = on.interaction_arch(hidden, pooled)
    assert row.shape == (BATCH, 16) and on.interaction_arch.output_width == 16
    assert not row[:, on.interaction_arch.output_dim :].any()  # the padding is zeros

    want_logits, want_pooled_grad, want_grads = _head_and_grads(off, dense, pooled)
    got_logits, got_pooled_grad, got_grads = _head_and_grads(on, dense, pooled)
    torch.testing.assert_close(got_logits, want_logits, **FP32)
    torch.testing.assert_close(got_pooled_grad, want_pooled_grad, **FP32)
    assert set(got_grads) == set(want_grads) == {n for n, _ in off.named_parameters()}
    for name, grad in want_grads.items():
        # The first top layer's gradient keeps its stored [out, 10] shape (no padded column).
        torch.testing.assert_close(got_grads[name], grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")


def test_padding_leaves_state_dict_keys_and_shapes_unchanged():
    off, on = _model("off"), _model("on")
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes(on) == shapes(off)
    assert on.over_arch.model[0].weight.shape == (12, off.interaction_arch.output_dim)
    on.load_state_dict(off.state_dict(), strict=True)  # each loads the other's checkpoint
    off.load_state_dict(on.state_dict(), strict=True)


def test_padded_interaction_under_bf16_autocast_matches_unpadded():
    off, on = _model("off", top_mlp=(7, 1)), _model("on", top_mlp=(7, 1))  # 7: unaligned too
    on.load_state_dict(off.state_dict())
    dense, pooled = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = off.head(dense, pooled), on.head(dense, pooled)
    assert got.dtype == want.dtype == torch.float32  # the logit layer stays float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_single_layer_top_mlp_takes_the_padded_row():
    off, on = _model("off", top_mlp=(1,)), _model("on", top_mlp=(1,))
    on.load_state_dict(off.state_dict())
    dense, pooled = _inputs(3)
    torch.testing.assert_close(on.head(dense, pooled), off.head(dense, pooled), **FP32)


def test_auto_pads_only_where_the_triton_interaction_runs_on_cuda():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # resolved by name: no GPU needed
    assert interaction_pads(ModelConfig(), cuda)
    assert interaction_pads(ModelConfig(interaction_backend="triton"), cuda)
    assert not interaction_pads(ModelConfig(interaction_backend="reference"), cuda)
    assert not interaction_pads(ModelConfig(), cpu)
    assert not interaction_pads(ModelConfig(interaction_backend="triton"), cpu)
    assert interaction_pads(ModelConfig(interaction_pad="on", interaction_backend="reference"), cpu)
    assert not interaction_pads(ModelConfig(interaction_pad="off"), cuda)
    assert not _model("auto").interaction_arch.pad  # built on CPU


def test_an_unknown_interaction_pad_is_a_one_line_config_error():
    from recaccel.config import load_config

    with pytest.raises(ConfigError, match="interaction_pad") as err:
        load_config(None, ['model.interaction_pad="yes"'])
    assert "\n" not in str(err.value)


def _meta_model(pad: bool) -> DLRM:
    torch.manual_seed(4)
    keys = [f"f{i}" for i in range(FIELDS)]
    inter = InteractionArch(FIELDS, DIM, backend="reference", pad=pad)
    over = OverArch(inter.output_dim, [5, 1], padded_input=pad)
    emb = PerTableEmbeddingBag(keys, [12] * FIELDS, DIM)
    return DLRM(SparseArch(emb), DenseArch(3, [6, DIM]), inter, over).double()


def _task_batch():
    from tests.helpers.meta_batches import make_task_batch

    return make_task_batch(3, 4, 5, loss="bce", seed=5)


@pytest.mark.parametrize("adapt", ["top_mlp", "head"])  # interaction output shared | per task
@pytest.mark.parametrize("engine", ["batched", "vmap"])
def test_meta_engines_train_a_padded_model_as_the_unpadded_one(engine, adapt):
    cfg = MetaConfig(inner_steps=2, inner_lr=0.3, adapt=adapt)
    results = []
    for pad in (False, True):
        learner = MetaLearner(_meta_model(pad), cfg, loss="bce", engine=engine)
        loss, _ = learner.step_loss(_task_batch())
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad for n, p in learner.named_parameters() if p.grad is not None})
        )
    (want_loss, want), (got_loss, got) = results
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-9, atol=1e-12)
    assert set(got) == set(want) and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12)


def test_dcnv2_ignores_interaction_pad():
    cfg = ModelConfig(
        embedding_dim=DIM,
        bottom_mlp=[6, DIM],
        top_mlp=[5, 1],
        interaction="dcnv2",
        dcn_rank=3,
        interaction_pad="on",
    )
    model = build_model(cfg, OptimConfig(), _schema(), torch.device("cpu"))
    assert not model.over_arch.padded_input and model.over_arch.model[0].in_features == DIM * (FIELDS + 1)
    dense, pooled = _inputs(6)
    assert model.head(dense, pooled).shape == (BATCH,)
