"""Packed embedding bag, reference backend: against a naive per-bag definition.

The oracle below loops over bags with one table per feature (no packing, no CSR tricks)
and writes the optimizer rules of SparseOptimConfig's docstring with dense masks, so it
shares no code with the module.
"""

from __future__ import annotations

import dataclasses
import doctest
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recaccel.config import Pooling, SparseOptimizer, choices
from recaccel.errors import ConfigError, DataError
from recaccel.ops.embedding import (
    OPTIMIZER_STATES,
    OPTIMIZERS,
    POOLINGS,
    InvalidIdError,
    PackedEmbeddingBag,
    SparseOptimConfig,
    TableSpec,
    init_table_weights,
    reference,
)
from recaccel.ops.embedding import module as embedding_module
from recaccel.ops.embedding.fbgemm import FBGEMM_OPTIMIZERS
from recaccel.ops.embedding.packing import gather_pack_ids
from recaccel.sparse import SparseFeatures

pytestmark = pytest.mark.numeric


TABLES = [
    TableSpec("a", 11, 4, pooling="mean", optimizer="sgd"),
    TableSpec("b", 7, 4, features=["b1", "b2"], optimizer="rowwise_adagrad"),
    TableSpec("c", 5, 8, optimizer="adam"),
    TableSpec("d", 9, 4, pooling="mean", optimizer="rowwise_adagrad"),
]
KEYS = ["b2", "c", "a", "d", "b1"]
ROWS = {"a": 11, "b1": 7, "b2": 7, "c": 5, "d": 9}


def _table_of(tables: list[TableSpec]) -> dict[str, TableSpec]:
    return {f: t for t in tables for f in t.features}


def naive_pool(
    tables: list[TableSpec], weights: dict[str, torch.Tensor], sf: SparseFeatures
) -> list[torch.Tensor]:
    """[B, D_f] per feature of ``sf``, bag by bag."""
    table_of, b = _table_of(tables), sf.batch_size
    out = []
    for f, key in enumerate(sf.keys):
        t = table_of[key]
        bags = []
        for i in range(b):
            s, e = int(sf.offsets[f * b + i]), int(sf.offsets[f * b + i + 1])
            ids = sf.values[s:e]
            w = torch.ones(e - s) if sf.weights is None else sf.weights[s:e]
            v = (weights[t.name][ids] * w[:, None]).sum(0)
            bags.append(v / (e - s) if t.pooling == "mean" and e > s else v)
        out.append(torch.stack(bags) if bags else torch.zeros(0, t.dim))
    return out


def naive_step(
    table: TableSpec, cfg: SparseOptimConfig, state: dict, grad: torch.Tensor, touched: torch.Tensor
):
    """The documented update of one table, on the rows marked in ``touched`` [R] bool."""
    w = state["weight"].clone()
    new = dict(state)
    wt, g = w[touched], grad[touched]
    if table.optimizer == "sgd":
        w[touched] = wt - cfg.lr * (g + cfg.weight_decay * wt)
    elif table.optimizer == "rowwise_adagrad":
        g2 = g + cfg.weight_decay * wt
        m = state["momentum1"].clone()
        m[touched] += (g2**2).sum(1) / table.dim
        w[touched] = wt - cfg.lr * g2 / (m[touched].sqrt()[:, None] + cfg.eps)
        new["momentum1"] = m
    else:
        t = int(state["step"]) + 1
        m1, m2 = state["momentum1"].clone(), state["momentum2"].clone()
        m1[touched] = cfg.beta1 * m1[touched] + (1 - cfg.beta1) * g
        m2[touched] = cfg.beta2 * m2[touched] + (1 - cfg.beta2) * g**2
        mhat, vhat = m1[touched] / (1 - cfg.beta1**t), m2[touched] / (1 - cfg.beta2**t)
        w[touched] = wt - cfg.lr * (mhat / (vhat.sqrt() + cfg.eps) + cfg.weight_decay * wt)
        new.update(momentum1=m1, momentum2=m2, step=torch.tensor(t))
    new["weight"] = w
    return new


def _batch(make, seed: int, keys=KEYS, batch_size=3, weighted=True, max_len=4) -> SparseFeatures:
    gen = torch.Generator().manual_seed(seed)
    return make(ROWS, keys, batch_size, max_len=max_len, weighted=weighted, generator=gen)


def _grad_like(out: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), weighted=st.booleans(), batch_size=st.integers(1, 4))
def test_forward_matches_naive_definition(seed, weighted, batch_size, sparse_batch):
    m = PackedEmbeddingBag(TABLES, backend="reference", seed=seed)
    sf = _batch(sparse_batch, seed, batch_size=batch_size, weighted=weighted)
    expected = naive_pool(TABLES, init_table_weights(TABLES, seed=seed), sf)
    torch.testing.assert_close(m.forward_concat(sf), torch.cat(expected, dim=1))
    for layout, names, out in zip(m.plan.packs, m.pack_features(sf.keys), m.forward_packs(sf)):
        assert out.shape == (batch_size, len(names), layout.dim)
        torch.testing.assert_close(out, torch.stack([expected[sf.keys.index(n)] for n in names], dim=1))
    same_dim = ["d", "b1", "a"]
    sf4 = _batch(sparse_batch, seed + 1, keys=same_dim, batch_size=batch_size, weighted=weighted)
    expected4 = naive_pool(TABLES, init_table_weights(TABLES, seed=seed), sf4)
    torch.testing.assert_close(m(sf4), torch.stack(expected4, dim=1))


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_autograd_gradients_match_naive(sparse_grad, sparse_batch):
    m = PackedEmbeddingBag(TABLES, backend="reference", mode="autograd", sparse_grad=sparse_grad, seed=3)
    sf = _batch(sparse_batch, 4)
    out = m.forward_concat(sf)
    g = _grad_like(out, 5)
    (out * g).sum().backward()
    weights = {k: v.requires_grad_() for k, v in init_table_weights(TABLES, seed=3).items()}
    (torch.cat(naive_pool(TABLES, weights, sf), dim=1) * g).sum().backward()
    assert {n for n, _ in m.named_parameters()} == {f"weight_{p}" for p in range(len(m.plan.packs))}
    for layout in m.plan.packs:
        grad = getattr(m, f"weight_{layout.index}").grad
        assert grad.is_sparse == sparse_grad
        grad = grad.to_dense()
        for t, off in zip(layout.tables, layout.row_offsets):
            torch.testing.assert_close(grad[off : off + t.num_rows], weights[t.name].grad)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("piece_rows", [None, 2])
def test_fused_step_matches_documented_rules(optimizer, weight_decay, piece_rows, sparse_batch, monkeypatch):
    if piece_rows is not None:  # coalesce and update a few rows at a time
        monkeypatch.setattr(reference, "rows_per_piece", lambda dim: piece_rows)
    tables = [dataclasses.replace(t, optimizer=optimizer) for t in TABLES]
    cfg = SparseOptimConfig(lr=0.1, eps=1e-3, weight_decay=weight_decay)
    m = PackedEmbeddingBag(tables, backend="reference", optim=cfg, seed=7)
    assert list(m.parameters()) == []
    expected = {t.name: {k: v.clone() for k, v in m.table_state(t.name).items()} for t in tables}
    for step in range(2):
        sf = _batch(sparse_batch, 10 + step)
        out = m.forward_concat(sf)
        g = _grad_like(out, 20 + step)
        weights = {n: s["weight"].clone().requires_grad_() for n, s in expected.items()}
        (torch.cat(naive_pool(tables, weights, sf), dim=1) * g).sum().backward()
        (out * g).sum().backward()
        for t in tables:
            touched = torch.zeros(t.num_rows, dtype=torch.bool)
            for f, key in enumerate(sf.keys):
                if key in t.features:
                    b = sf.batch_size
                    touched[sf.values[int(sf.offsets[f * b]) : int(sf.offsets[(f + 1) * b])]] = True
            expected[t.name] = naive_step(t, cfg, expected[t.name], weights[t.name].grad, touched)
        for t in tables:
            got = m.table_state(t.name)
            assert set(got) == set(expected[t.name])
            for k in got:
                torch.testing.assert_close(got[k], expected[t.name][k], msg=f"{t.name}.{k} after step {step}")


def test_eval_mode_and_no_grad_do_not_update(sparse_batch):
    m = PackedEmbeddingBag(TABLES, backend="reference", seed=1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sf = _batch(sparse_batch, 2)
    m.eval()
    out = m.forward_concat(sf)
    assert not out.requires_grad
    m.train()
    with torch.no_grad():
        m.forward_concat(sf)
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_packing_groups_by_dim_and_optimizer():
    m = PackedEmbeddingBag(TABLES, backend="reference")
    layout = [(p.dim, p.optimizer, [t.name for t in p.tables], p.row_offsets) for p in m.plan.packs]
    assert layout == [
        (4, "sgd", ["a"], (0,)),
        (4, "rowwise_adagrad", ["b", "d"], (0, 7)),
        (8, "adam", ["c"], (0,)),
    ]
    assert m.pack_features(KEYS) == [["a"], ["b2", "d", "b1"], ["c"]]
    assert m.weight_1.shape == (16, 4) and m.momentum1_1.shape == (16,)


def test_empty_bags_batch_of_one_and_absent_features(sparse_batch):
    m = PackedEmbeddingBag(TABLES, backend="reference", seed=0)
    empty = _batch(sparse_batch, 0, max_len=0)
    assert empty.values.numel() == 0
    torch.testing.assert_close(m.forward_concat(empty), torch.zeros(3, 24))
    one = _batch(sparse_batch, 1, keys=["b1"], batch_size=1)
    outs = m.forward_packs(one)
    assert [tuple(o.shape) for o in outs] == [(1, 0, 4), (1, 1, 4), (1, 0, 8)]
    torch.testing.assert_close(m(one)[:, 0], naive_pool(TABLES, init_table_weights(TABLES, seed=0), one)[0])


def test_init_is_deterministic_and_bounded():
    a = PackedEmbeddingBag(TABLES, backend="reference", seed=5).state_dict()
    b = PackedEmbeddingBag(
        TABLES, backend="reference", generator=torch.Generator().manual_seed(5)
    ).state_dict()
    c = PackedEmbeddingBag(TABLES, backend="reference", seed=6).state_dict()
    for t in TABLES:
        torch.testing.assert_close(a[f"{t.name}.weight"], b[f"{t.name}.weight"])
        assert not torch.equal(a[f"{t.name}.weight"], c[f"{t.name}.weight"])
        assert a[f"{t.name}.weight"].abs().max() <= t.num_rows**-0.5
    with pytest.raises(ConfigError, match="seed or generator"):
        PackedEmbeddingBag(TABLES, seed=1, generator=torch.Generator())


def test_checkpoint_round_trip_with_weights_only_load(sparse_batch):
    m = PackedEmbeddingBag(TABLES, backend="reference", seed=0)
    sf = _batch(sparse_batch, 3)
    m.forward_concat(sf).sum().backward()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert sorted(loaded) == sorted(
        ["a.weight", "b.weight", "b.momentum1", "c.weight", "c.momentum1", "c.momentum2", "c.step",
         "d.weight", "d.momentum1"]
    )  # fmt: skip
    assert loaded["c.momentum1"].shape == (5, 8) and loaded["b.momentum1"].shape == (7,)
    fresh = PackedEmbeddingBag(TABLES, backend="reference", seed=9)
    fresh.load_state_dict(loaded)
    for k, v in m.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v)
    parent = torch.nn.ModuleDict({"emb": fresh})
    assert "emb.c.step" in parent.state_dict()
    bad = dict(loaded)
    bad.pop("a.weight")
    bad["zzz.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="a.weight") as err:
        fresh.load_state_dict(bad)
    assert "zzz.weight" in str(err.value)
    bad = dict(loaded, **{"a.weight": torch.zeros(3, 4)})
    with pytest.raises(RuntimeError, match="size mismatch for a.weight"):
        fresh.load_state_dict(bad)


def test_out_of_range_and_negative_ids_name_the_feature(sparse_batch):
    m = PackedEmbeddingBag(TABLES, backend="reference", bounds_check=False)  # reference always checks
    sf = _batch(sparse_batch, 0, keys=["a", "b1"], batch_size=2, max_len=3)
    for bad_id in (7, -1):
        values = sf.values.clone()
        f1_start = int(sf.offsets[2])
        if f1_start == values.numel():
            pytest.fail("test batch has no id in feature b1")
        values[f1_start] = bad_id
        with pytest.raises(
            InvalidIdError, match=rf"feature 'b1': id {bad_id} .* out of range \[0, 7\)"
        ) as err:
            m(SparseFeatures(sf.keys, values, sf.offsets))
        assert isinstance(err.value, IndexError) and isinstance(err.value, DataError)
        assert err.value.column == "b1"


def test_bad_batches_raise_clear_errors(sparse_batch):
    m = PackedEmbeddingBag(TABLES, backend="reference")
    sf = _batch(sparse_batch, 0, keys=["a"], batch_size=2)
    with pytest.raises(DataError, match="'zz' is looked up by no table"):
        m(SparseFeatures(["zz"], sf.values, sf.offsets))
    with pytest.raises(DataError, match="appears twice"):
        m(SparseFeatures(["a", "a"], torch.zeros(0, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)))
    for keys, offsets in [
        (["a"], [0, 1, 3]),  # ends past len(values)
        (["a"], [0, 2, 1, 2]),  # decreasing
        (["a", "b1"], [0, 5, 2]),  # a feature ends past len(values)
        (["a", "b1"], [0, -3, 2]),  # a feature ends before 0
    ]:
        with pytest.raises(InvalidIdError, match="malformed sparse offsets"):
            m.forward_concat(SparseFeatures(keys, torch.zeros(2, dtype=torch.int64), torch.tensor(offsets)))
    with pytest.raises(DataError, match="must be integers"):
        m(SparseFeatures(["a"], torch.zeros(2), torch.tensor([0, 1, 2])))
    with pytest.raises(ValueError, match="different dims|one dim"):
        m(_batch(sparse_batch, 0, keys=["a", "c"]))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TableSpec("t", 0, 4), "num_rows"),
        (lambda: TableSpec("t", 3, 4, pooling="max"), "pooling"),
        (lambda: TableSpec("t", 3, 4, optimizer="lamb"), "optimizer"),
        (lambda: TableSpec("", 3, 4), "name"),
        (lambda: SparseOptimConfig(lr=0), "lr"),
        (lambda: SparseOptimConfig(beta2=1.0), "beta2"),
        (lambda: PackedEmbeddingBag([TableSpec("t", 3, 4), TableSpec("t", 3, 4)]), "duplicate table"),
        (lambda: PackedEmbeddingBag([TableSpec("t", 3, 4), TableSpec("u", 3, 4, features=["t"])]), "claimed"),
        (lambda: PackedEmbeddingBag([TableSpec("t", 3, 4)], mode="dense"), "mode"),
    ],
)
def test_bad_specs_raise_config_error(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_zero_row_batch():
    m = PackedEmbeddingBag(TABLES, backend="reference")
    sf = SparseFeatures(["a", "c"], torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert m.forward_concat(sf).shape == (0, 12)
    assert [tuple(o.shape) for o in m.forward_packs(sf)] == [(0, 1, 4), (0, 0, 4), (0, 1, 8)]


# keys, bag lengths (feature-major, B=2), index of the bad id, its feature and batch row.
EMPTY_FEATURE_CASES = [
    (["a", "b1", "d"], [2, 0, 0, 0, 0, 1], 0, "a", 0),  # first id of the batch
    (["a", "b1", "d"], [2, 0, 0, 0, 0, 1], 2, "d", 1),  # first id after an empty feature
    (["b1", "a", "d"], [0, 0, 1, 1, 0, 0], 1, "a", 1),  # last id, then an empty feature
    (["b1", "d", "a"], [0, 0, 0, 1, 0, 0], 0, "d", 1),  # only id, empty features around it
]


@pytest.mark.parametrize("keys, lengths, bad, feature, row", EMPTY_FEATURE_CASES)
def test_bad_id_next_to_empty_features_names_its_feature(keys, lengths, bad, feature, row):
    m = PackedEmbeddingBag(TABLES, backend="reference", seed=0)
    per_feature = [lengths[2 * f] + lengths[2 * f + 1] for f in range(len(keys))]
    # Every id at its table's last row: all in range.
    values = torch.tensor([ROWS[k] - 1 for k, n in zip(keys, per_feature) for _ in range(n)])
    sf = SparseFeatures.from_lengths(keys, values, torch.tensor(lengths))
    expected = naive_pool(TABLES, init_table_weights(TABLES, seed=0), sf)
    torch.testing.assert_close(m.forward_concat(sf), torch.cat(expected, dim=1))
    values = values.clone()
    values[bad] = ROWS[feature]  # one past the end of its table
    with pytest.raises(
        InvalidIdError,
        match=rf"feature '{feature}': id {ROWS[feature]} at batch row {row} .* \[0, {ROWS[feature]}\)",
    ):
        m.forward_concat(SparseFeatures(keys, values, sf.offsets))


@settings(max_examples=20, deadline=None)
@given(
    keys=st.permutations(list(ROWS)).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])),
    batch_size=st.integers(1, 3),
    data=st.data(),
)
def test_id_check_finds_the_first_bad_id(keys, batch_size, data):
    """Against a loop over features and bags: the first bad id in the batch's order is named."""
    num_bags = len(keys) * batch_size
    lengths = data.draw(st.lists(st.integers(0, 2), min_size=num_bags, max_size=num_bags))
    values, first_bad = [], None
    for f, key in enumerate(keys):
        for b in range(batch_size):
            for _ in range(lengths[f * batch_size + b]):
                v = data.draw(st.integers(-1, ROWS[key]))
                if first_bad is None and not 0 <= v < ROWS[key]:
                    first_bad = (key, v, b)
                values.append(v)
    sf = SparseFeatures.from_lengths(keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths))
    m = PackedEmbeddingBag(TABLES, backend="reference", seed=0)
    if first_bad is None:
        m.forward_concat(sf)
        return
    key, v, b = first_bad
    with pytest.raises(InvalidIdError, match=rf"feature '{key}': id {v} at batch row {b} "):
        m.forward_concat(sf)


@pytest.mark.parametrize("max_rows", [1, 3, 1000])
@pytest.mark.parametrize("layout", ["batch_major", "feature_major", "broadcast"])
def test_row_gradients_in_pieces_equal_the_dense_gradient(max_rows, layout, sparse_batch):
    """Pieces of coalesced row gradients, put together, are autograd's dense gradient."""
    m = PackedEmbeddingBag(TABLES, backend="reference", seed=3)
    sf = _batch(sparse_batch, 4, batch_size=4)
    layout_of = m.plan.packs[1]  # tables b (features b1, b2) and d: shared table, row shift, mean
    route = m.plan.route(sf.keys, torch.device("cpu")).packs[1]
    names = [sf.keys[i] for i in route.features]
    b, s, dim = sf.batch_size, len(names), layout_of.dim
    gen = torch.Generator().manual_seed(5)
    if layout == "batch_major":
        grad_out = torch.randn(b, s, dim, generator=gen)
    elif layout == "feature_major":
        grad_out = torch.randn(s, b, dim, generator=gen).transpose(0, 1)
    else:
        grad_out = torch.randn(1, s, dim, generator=gen).expand(b, s, dim)
    weights = {k: v.requires_grad_() for k, v in init_table_weights(TABLES, seed=3).items()}
    pooled = naive_pool(TABLES, weights, sf)
    (torch.stack([pooled[sf.keys.index(n)] for n in names], dim=1) * grad_out).sum().backward()
    dense = torch.cat([weights[t.name].grad for t in layout_of.tables])

    ids = gather_pack_ids(sf, route.local, b, with_bags=True)
    pieces = list(reference.coalesce_row_grads(grad_out, ids, max_rows=max_rows))
    rows = torch.cat([r for r, _ in pieces])
    assert all(0 < r.numel() <= max_rows for r, _ in pieces)
    assert torch.equal(rows, torch.unique(ids.rows))  # ascending, each touched row once
    got = torch.zeros_like(dense).index_copy_(0, rows, torch.cat([g for _, g in pieces]))
    torch.testing.assert_close(got, dense)


def test_docstring_example_runs():
    result = doctest.testmod(embedding_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0


def test_vocabulary_comes_from_the_config_aliases():
    assert POOLINGS == choices(Pooling)
    assert OPTIMIZERS == choices(SparseOptimizer)
    assert set(OPTIMIZER_STATES) == set(OPTIMIZERS)  # every optimizer says what state it keeps
    assert FBGEMM_OPTIMIZERS == ("sgd", "rowwise_adagrad")  # FBGEMM on CPU has no Adam
