"""MeLU: shapes, the forward written out, and meta-learning through MetaLearner."""

from __future__ import annotations

import pytest
import torch

from recaccel.config import MetaConfig
from recaccel.errors import ConfigError
from recaccel.io.format.schema import SparseField
from recaccel.meta import MetaLearner
from recaccel.meta.synthetic import SyntheticTasks
from recaccel.models.melu import MeLU, MeLUConfig, melu_embedding
from recaccel.sparse import Batch, SparseFeatures


def _cfg(**kw) -> MeLUConfig:
    item = [SparseField("rate", 6), SparseField("genre", 25, multi_hot=True)]
    user = [SparseField("gender", 2), SparseField("age", 7)]
    kw.setdefault("embedding_dim", 8)
    return MeLUConfig(item_fields=item, user_fields=user, **kw)


def _batch(cfg: MeLUConfig, rows: int, gen: torch.Generator) -> Batch:
    lengths = torch.cat(
        [torch.randint(1, 4 if f.multi_hot else 2, (rows,), generator=gen) for f in cfg.fields]
    )
    per_field = lengths.view(len(cfg.fields), rows).sum(1)
    values = torch.cat(
        [torch.randint(0, f.cardinality, (int(n),), generator=gen) for f, n in zip(cfg.fields, per_field)]
    )
    sparse = SparseFeatures.from_lengths(cfg.feature_names, values, lengths)
    return Batch(
        torch.randn(rows, cfg.num_dense, generator=gen),
        sparse,
        torch.randint(1, 6, (rows,), generator=gen).float(),
    )


def test_forward_is_mean_pooled_concat_then_mlp():
    torch.manual_seed(0)
    cfg = _cfg(num_dense=2)
    model = MeLU(cfg)
    batch = _batch(cfg, 5, torch.Generator().manual_seed(1))
    pooled = model.embed(batch.sparse)
    assert pooled.shape == (5, 4, 8)
    bags = model.sparse_arch.embedding.bags
    for f, name in enumerate(cfg.feature_names):
        values, offsets, _ = batch.sparse.field(name)
        for b in range(5):
            ids = values[offsets[b] : offsets[b + 1]]
            torch.testing.assert_close(pooled[b, f], bags[f].weight[ids].mean(0))
    x = torch.cat([pooled.flatten(1), batch.dense], 1)
    layers = [m for m in model.over_arch.model if isinstance(m, torch.nn.Linear)]
    assert [layer.out_features for layer in layers] == [64, 64, 1]
    h = torch.relu(layers[1](torch.relu(layers[0](x))))
    torch.testing.assert_close(model(batch), layers[2](h).squeeze(-1))


def test_dense_mlp_and_packed_embedding():
    cfg = _cfg(num_dense=3, dense_mlp=[4], hidden=[16, 8])
    emb = melu_embedding(cfg, backend="reference", mode="autograd", seed=0)
    model = MeLU(cfg, emb)
    batch = _batch(cfg, 6, torch.Generator().manual_seed(2))
    assert model(batch).shape == (6,)
    assert model.interaction_arch.output_dim == 4 * 8 + 4


@pytest.mark.parametrize(
    "kw", [{"hidden": [0]}, {"pooling": "max"}, {"dense_mlp": [4]}, {"embedding_dim": 0}]
)
def test_bad_config_is_rejected(kw):
    with pytest.raises(ConfigError):
        _cfg(**kw)
    with pytest.raises(ConfigError, match="repeat"):
        MeLUConfig(item_fields=[SparseField("a", 2)], user_fields=[SparseField("a", 3)])


def _melu_for(world: SyntheticTasks, seed: int = 0) -> MeLU:
    torch.manual_seed(seed)
    fields = [SparseField(k, c) for k, c in zip(world.keys, world.cardinalities)]
    cfg = MeLUConfig(
        item_fields=fields[:2],
        user_fields=fields[2:],
        embedding_dim=4,
        hidden=[16, 16],
        num_dense=world.num_dense,
    )
    return MeLU(cfg)


def test_meta_learner_adapts_only_the_mlp_and_engines_agree():
    world = SyntheticTasks(num_dense=2, cardinalities=[10, 10, 10], loss="mse", seed=3)
    tb = world.sample(4, 6, 5, generator=torch.Generator().manual_seed(0), min_rows=3)
    grads = {}
    for engine in ("batched", "loop"):
        model = _melu_for(world).double()
        learner = MetaLearner(
            model, MetaConfig(inner_steps=2, inner_lr=0.05, adapt="head"), loss="mse", engine=engine
        )
        assert all(n.startswith("over_arch.") for n in learner.plan.names)  # no dense parameters to adapt
        loss, _ = learner.step_loss(tb)
        loss.backward()
        grads[engine] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["loop"].items():
        torch.testing.assert_close(grads["batched"][name], g, rtol=1e-6, atol=1e-9)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes; threads only contend on a shared machine
    yield
    torch.set_num_threads(before)


def test_meta_training_improves_adapted_rating_error(one_thread):
    world = SyntheticTasks(num_dense=2, cardinalities=[10, 10, 10], loss="mse", task_scale=1.0, seed=4)
    learner = MetaLearner(_melu_for(world), MetaConfig(inner_steps=1, inner_lr=0.05), loss="mse")
    opt = torch.optim.Adam(learner.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    held_out = world.sample(64, 8, 8, generator=torch.Generator().manual_seed(9))

    def query_mse():
        pred = learner.adapt_and_predict(held_out)
        err = (pred - held_out.query.labels.view(64, 8)) ** 2
        return float((err * held_out.query_mask).sum() / held_out.query_mask.sum())

    before = query_mse()
    for _ in range(60):
        loss, _ = learner.step_loss(world.sample(16, 8, 8, generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert query_mse() < 0.5 * before
