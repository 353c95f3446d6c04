"""Meta-gradients of every engine against a plain per-task reference, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from recaccel.config import MetaConfig
from recaccel.errors import ConfigError
from recaccel.meta import SHIFT, MetaLearner
from tests.helpers.meta_batches import DIM, NUM_FIELDS, make_dlrm, make_task_batch

pytestmark = pytest.mark.numeric


TOL = {"rtol": 1e-6, "atol": 1e-9}


class _Head(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense, pooled):
        return self.model.head(dense, pooled)


def _masked_mean(pred, labels, mask, loss):
    if loss == "bce":
        per_row = F.binary_cross_entropy_with_logits(pred, labels, reduction="none")
    else:
        per_row = (pred - labels) ** 2
    return (mask * per_row).sum() / torch.clamp(mask.sum(), min=1.0)


def reference_step(model, tb, mode, steps, first_order, loss, rate_of):
    """A Python loop over tasks; support and query embedded separately; model.head per task."""
    t_, s_, q_ = tb.num_tasks, tb.support_size, tb.query_size
    pooled_s = model.embed(tb.support.sparse).view(t_, s_, NUM_FIELDS, DIM)
    pooled_q = model.embed(tb.query.sparse).view(t_, q_, NUM_FIELDS, DIM)
    dense_s, dense_q = tb.support.dense.view(t_, s_, -1), tb.query.dense.view(t_, q_, -1)
    y_s, y_q = tb.support.labels.view(t_, s_), tb.query.labels.view(t_, q_)
    head = _Head(model)
    named = dict(model.named_parameters())
    names = [n for n in named if n.startswith("over_arch.")]
    if mode != "top_mlp":
        names = [n for n in named if n.startswith("dense_arch.")] + names
    losses, preds = [], []
    for t in range(t_):
        p = {n: named[n] for n in names}
        shift = None
        if mode == "head_and_embedding_shift":
            shift = torch.zeros(NUM_FIELDS, DIM, dtype=torch.float64, requires_grad=True)
        for _ in range(steps):
            emb = pooled_s[t] if shift is None else pooled_s[t] + shift
            pred = functional_call(head, {f"model.{n}": v for n, v in p.items()}, (dense_s[t], emb))
            support_loss = _masked_mean(pred, y_s[t], tb.support_mask[t], loss)
            inputs = list(p.values()) + ([shift] if shift is not None else [])
            grads = torch.autograd.grad(support_loss, inputs, create_graph=not first_order, retain_graph=True)
            if first_order:
                grads = [g.detach() for g in grads]
            p = {n: v - rate_of(n) * g for (n, v), g in zip(p.items(), grads)}
            if shift is not None:
                shift = shift - rate_of(SHIFT) * grads[-1]
        emb = pooled_q[t] if shift is None else pooled_q[t] + shift
        pred = functional_call(head, {f"model.{n}": v for n, v in p.items()}, (dense_q[t], emb))
        preds.append(pred)
        if tb.query_mask[t].sum() > 0:
            losses.append(_masked_mean(pred, y_q[t], tb.query_mask[t], loss))
    return torch.stack(losses).mean(), torch.stack(preds)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in module.named_parameters()
    }


def _compare(engine, mode, steps, first_order, meta_sgd, loss, embedding):
    tb = make_task_batch(4, 5, 6, loss=loss, seed=steps)
    model = make_dlrm(embedding)
    cfg = MetaConfig(inner_steps=steps, inner_lr=0.3, first_order=first_order, meta_sgd=meta_sgd, adapt=mode)
    learner = MetaLearner(model, cfg, loss=loss, engine=engine)
    gen = torch.Generator().manual_seed(7)
    for rate in learner.inner_lrs.values():  # distinct rates catch a rate applied to the wrong tensor
        rate.data.copy_(torch.rand(rate.shape, generator=gen, dtype=rate.dtype) * 0.4 + 0.05)

    meta_loss, info = learner.step_loss(tb)
    meta_loss.backward()
    got = _grads(learner)
    learner.zero_grad(set_to_none=True)

    rates = learner.inner_rates()

    def rate_of(name):
        return rates if isinstance(rates, float) else rates[name]

    ref_loss, _ = reference_step(model, tb, mode, steps, first_order, loss, rate_of)
    ref_loss.backward()
    want = _grads(learner)

    torch.testing.assert_close(meta_loss, ref_loss, **TOL)
    torch.testing.assert_close(info["query_loss"], ref_loss.detach(), **TOL)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # The test must exercise the embedding path: some embedding row got a gradient.
    assert any(got[n].abs().sum() > 0 for n in got if n.startswith("model.sparse_arch."))
    if meta_sgd:
        assert all(got[n].abs().sum() > 0 for n in got if n.startswith("inner_lrs."))


@pytest.mark.parametrize("mode", ["top_mlp", "head", "head_and_embedding_shift"])
@pytest.mark.parametrize("first_order", [True, False])
@pytest.mark.parametrize("meta_sgd", [False, True])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_batched_engine_matches_reference(mode, first_order, meta_sgd, steps):
    loss = "mse" if steps == 2 else "bce"
    embedding = "packed" if meta_sgd else "per_table"
    _compare("batched", mode, steps, first_order, meta_sgd, loss, embedding)


@pytest.mark.parametrize("engine", ["vmap", "loop"])
@pytest.mark.parametrize("mode", ["top_mlp", "head", "head_and_embedding_shift"])
@pytest.mark.parametrize("first_order", [True, False])
def test_vmap_and_loop_engines_match_reference(engine, mode, first_order):
    _compare(engine, mode, 2, first_order, True, "bce", "per_table")


def test_padded_rows_do_not_matter():
    tb = make_task_batch(4, 5, 6, loss="mse", seed=3)
    cfg = MetaConfig(inner_steps=2, inner_lr=0.2, adapt="head_and_embedding_shift")

    def run(batch):
        learner = MetaLearner(make_dlrm(), cfg, loss="mse")
        loss, _ = learner.step_loss(batch)
        loss.backward()
        return loss.detach(), _grads(learner), learner.adapt_and_predict(batch)

    loss0, grads0, pred0 = run(tb)
    gen = torch.Generator().manual_seed(11)
    for batch, mask in ((tb.support, tb.support_mask), (tb.query, tb.query_mask)):
        pad = mask.flatten() == 0
        batch.labels[pad] = 1e3
        batch.dense[pad] = (
            torch.randn(int(pad.sum()), batch.dense.shape[1], generator=gen, dtype=torch.float64) * 50
        )
    loss1, grads1, pred1 = run(tb)
    torch.testing.assert_close(loss1, loss0, **TOL)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], **TOL)
    real = tb.query_mask > 0
    torch.testing.assert_close(pred1[real], pred0[real], **TOL)


@pytest.mark.parametrize("mode", ["top_mlp", "head_and_embedding_shift"])
def test_predictions_match_reference(mode):
    tb = make_task_batch(4, 5, 6, loss="bce", seed=5)
    model = make_dlrm()
    learner = MetaLearner(model, MetaConfig(inner_steps=2, inner_lr=0.5, adapt=mode), loss="bce")
    adapted, base = learner.predict(tb)
    _, ref_pred = reference_step(model, tb, mode, 2, True, "bce", lambda n: 0.5)
    torch.testing.assert_close(adapted, ref_pred.detach(), **TOL)
    torch.testing.assert_close(learner.adapt_and_predict(tb), adapted, **TOL)
    with torch.no_grad():
        head_only = model.head(tb.query.dense, model.embed(tb.query.sparse)).view(4, 6)
    torch.testing.assert_close(base, head_only, **TOL)
    torch.testing.assert_close(learner.predict_without_adaptation(tb), head_only, **TOL)
    assert not adapted.requires_grad
    assert all(p.grad is None for p in learner.parameters())


def test_support_loss_info_is_the_unadapted_support_loss():
    tb = make_task_batch(4, 5, 6, loss="bce", seed=2)
    model = make_dlrm()
    _, info = MetaLearner(model, MetaConfig(inner_steps=1), loss="bce").step_loss(tb)
    with torch.no_grad():
        pred = model.head(tb.support.dense, model.embed(tb.support.sparse)).view(4, 5)
        per_task = [
            _masked_mean(pred[t], tb.support.labels.view(4, 5)[t], tb.support_mask[t], "bce")
            for t in range(4)
        ]
        present = tb.support_mask.sum(1) > 0
    torch.testing.assert_close(info["support_loss"], torch.stack(per_task)[present].mean(), **TOL)
    assert int(info["tasks"]) == int((tb.query_mask.sum(1) > 0).sum())


def test_meta_parameters_hold_head_and_rates_not_embeddings():
    model = make_dlrm()
    learner = MetaLearner(model, MetaConfig(meta_sgd=True, adapt="head_and_embedding_shift"))
    ids = {id(p) for p in learner.meta_parameters()}
    assert {id(p) for p in model.over_arch.parameters()} <= ids
    assert {id(p) for p in model.dense_arch.parameters()} <= ids
    assert {id(p) for p in learner.inner_lrs.values()} <= ids
    assert not ids & {id(p) for p in learner.embedding_parameters()}
    assert learner.inner_rates()[SHIFT].shape == (NUM_FIELDS, DIM)


@pytest.mark.parametrize(
    "kwargs",
    [{"adapt": "everything"}, {"inner_lr": 0.0}, {"inner_steps": -1}],
)
def test_bad_config_is_rejected(kwargs):
    with pytest.raises(ConfigError):
        MetaLearner(make_dlrm(), MetaConfig(**kwargs))


def test_batched_engine_rejects_non_mlp_head():
    model = make_dlrm()
    model.over_arch.model[1] = nn.Tanh()
    with pytest.raises(ConfigError, match="vmap"):
        MetaLearner(model, MetaConfig())
    MetaLearner(model, MetaConfig(), engine="vmap")  # the generic engine accepts it


def test_mismatched_task_batch_shapes_are_rejected():
    tb = make_task_batch(4, 5, 6)
    tb.support_mask = tb.support_mask[:, :4]
    with pytest.raises(ValueError, match="support"):
        MetaLearner(make_dlrm(), MetaConfig()).step_loss(tb)


def _packed_dlrm(mode: str):
    from recaccel.models.arches import DenseArch, InteractionArch, OverArch, SparseArch
    from recaccel.models.dlrm import DLRM
    from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
    from tests.helpers.meta_batches import KEYS, NUM_DENSE, ROWS

    torch.manual_seed(3)
    tables = [TableSpec(k, ROWS, DIM, optimizer="sgd") for k in KEYS]
    emb = PackedEmbeddingBag(tables, backend="reference", mode=mode, optim=SparseOptimConfig(lr=0.5), seed=3)
    inter = InteractionArch(NUM_FIELDS, DIM, backend="reference")
    return DLRM(SparseArch(emb), DenseArch(NUM_DENSE, [6, DIM]), inter, OverArch(inter.output_dim, [5, 1]))


@pytest.mark.parametrize("first_order", [True, False])
def test_fused_embedding_applies_the_meta_gradient_once(first_order):
    """Fused SGD moves each embedding row by -lr times the meta-gradient autograd mode computes."""
    tb = make_task_batch(4, 5, 6, loss="bce", seed=4)
    cfg = MetaConfig(inner_steps=2, inner_lr=0.3, first_order=first_order, adapt="head_and_embedding_shift")
    auto, fused = _packed_dlrm("autograd"), _packed_dlrm("fused")
    before = {k: v.clone() for k, v in fused.sparse_arch.embedding.state_dict().items()}
    for model in (auto, fused):
        loss, _ = MetaLearner(model, cfg, loss="bce").step_loss(tb)
        loss.backward()
    with torch.no_grad():  # the tables share dim and optimizer: one pack, one Parameter
        for p in auto.sparse_arch.embedding.parameters():
            p -= 0.5 * p.grad
    want = auto.sparse_arch.embedding.state_dict()
    got = fused.sparse_arch.embedding.state_dict()
    assert any((got[k] - before[k]).abs().max() > 0 for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
