"""The sparse learning rate as a device scalar: the Triton update kernels read it from a
float32 [1] tensor, so a captured training step's replays use each step's rate
(``PackedEmbeddingBag.keep_rates_in_place``); by default a change of rate makes a new
tensor, so an update keeps the rate of its lookup, as the reference backend does.

Under TRITON_INTERPRET=1 (conftest.py) on tiny shapes, against the float rate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.triton import backward as tiles
from recaccel.ops.embedding.triton.piece_lanes import LaneConfig
from recaccel.sparse import SparseFeatures
from recaccel.train.loop.schedule import set_group_rates
from tests.helpers.backward_tiles import CFG, copy_state, make_batch, make_state
from tests.helpers.marks import needs_triton

pytestmark = needs_triton

CONFIGS = [None, LaneConfig(piece_len=2, block_pieces=4, unroll=1, num_warps=2)]  # tiles, lanes


@pytest.mark.parametrize("config", CONFIGS, ids=["tiles", "lanes"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_the_update_kernels_read_the_rate_tensor_not_the_configs_float(optimizer, config):
    batch = make_batch([9, 5, 30], batch_size=6, max_len=4, seed=1)
    grad_out = batch.grad_out(8, seed=2)
    state = make_state(optimizer, batch, 8, torch.float32)
    want = copy_state(state)
    state.lr = torch.full((1,), 0.37, dtype=torch.float32, device=state.weight.device)
    tiles.fused_update(state, CFG, grad_out, batch.ids, batch.batch_size, config=config)  # CFG.lr = 0.1
    tiles.fused_update(
        want, dataclasses.replace(CFG, lr=0.37), grad_out, batch.ids, batch.batch_size, config=config
    )
    torch.testing.assert_close(state.weight, want.weight, rtol=0, atol=0)
    for name in want.states:
        torch.testing.assert_close(state.states[name], want.states[name], rtol=0, atol=0)


TABLES = [TableSpec("a", 13, 4, features=["a1", "a2"]), TableSpec("b", 7, 4, pooling="mean")]


def _batch(seed: int) -> SparseFeatures:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * 5,), generator=g)
    counts = [int(lengths[f * 5 : (f + 1) * 5].sum()) for f in range(3)]
    values = torch.cat([torch.randint(0, n, (c,), generator=g) for n, c in zip([13, 13, 7], counts)])
    return SparseFeatures.from_lengths(["a1", "a2", "b"], values, lengths)


def _rate_change_between_lookup_and_update(backend: str, in_place: bool = False) -> PackedEmbeddingBag:
    """A lookup at rate 0.1, the rate set to 0.5, then the lookup's backward (a semi-sync
    step looks the next batch up before that step's rate is set)."""
    module = PackedEmbeddingBag(TABLES, backend=backend, optim=SparseOptimConfig(lr=0.1), seed=3)
    if in_place:
        module.keep_rates_in_place()
    for seed in range(2):  # the rate tensors exist (made by the first update)
        out = module.forward_concat(_batch(seed))
        (out * 0.5).sum().backward()
    out = module.forward_concat(_batch(7))
    module.set_learning_rate(0.5)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return module


def _assert_same_tables(got: PackedEmbeddingBag, want: PackedEmbeddingBag) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    for key in want_sd:
        torch.testing.assert_close(got_sd[key], want_sd[key], rtol=1e-6, atol=1e-7, msg=key)


def _rate_changed_before_the_lookup() -> PackedEmbeddingBag:
    """The same sequence on the reference backend with the rate set to 0.5 before the lookup."""
    module = PackedEmbeddingBag(TABLES, backend="reference", optim=SparseOptimConfig(lr=0.1), seed=3)
    for seed in range(2):
        (module.forward_concat(_batch(seed)) * 0.5).sum().backward()
    module.set_learning_rate(0.5)
    out = module.forward_concat(_batch(7))
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return module


def test_the_two_sequences_train_different_tables():
    lookup_rate = _rate_change_between_lookup_and_update("reference").state_dict()
    update_rate = _rate_changed_before_the_lookup().state_dict()
    assert any(not torch.equal(lookup_rate[k], update_rate[k]) for k in lookup_rate)


def test_by_default_an_update_keeps_the_rate_of_its_lookup_as_the_reference_does():
    got = _rate_change_between_lookup_and_update("triton")
    _assert_same_tables(got, _rate_change_between_lookup_and_update("reference"))


def test_rates_kept_in_place_reach_an_update_whose_lookup_came_before_the_change():
    got = _rate_change_between_lookup_and_update("triton", in_place=True)
    _assert_same_tables(got, _rate_changed_before_the_lookup())


def test_a_dense_rate_held_in_a_tensor_is_refilled_in_place():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.1))
    held = optimizer.param_groups[0]["lr"]
    set_group_rates(optimizer, 0.25)
    assert optimizer.param_groups[0]["lr"] is held and float(held) == 0.25
    plain = torch.optim.SGD([param], lr=0.1)
    set_group_rates(plain, 0.25)
    assert plain.param_groups[0]["lr"] == 0.25
