"""Occurrence-tile programs that walk SUBTILES chunks of BLOCK_OCC sorted occurrences.

A program carries the sum of the segment open at a chunk's end into the next chunk and
writes head / tail partials only at its span's two edges, so rows that cross chunk edges
inside a span are finished by the program and only rows crossing span edges go through
the spanning-row kernel. Checked against float64 row sums (the gradient store) and the
reference optimizer (every sparse optimizer, 32- and 16-bit rows) on tiny shapes under
TRITON_INTERPRET=1 (set in conftest.py), with segment lengths chosen to end exactly on
chunk and span edges, a hot row across more spans than one fix-up step loads, a last
span whose trailing chunks hold no occurrence, and a single occurrence.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.errors import ConfigError
from recaccel.ops.embedding.triton import backward as tiles
from tests.helpers.backward_tiles import (
    CFG,
    DTYPES,
    OPTIMIZERS,
    assert_states_close,
    copy_state,
    float64_row_grads,
    make_batch,
    make_state,
    reference_update,
    sorted_rows_batch,
    two_steps,
)
from tests.helpers.marks import needs_triton

pytestmark = needs_triton

# With BLOCK_OCC 4 and SUBTILES 2 a span is 8 occurrences. Cumulative ends: 4 (chunk edge),
# 8 (span edge), 10, 16 (span edge after crossing a chunk edge), 19, 24 (span edge after
# crossing one from mid-span), 40 (two whole spans), 41.
EDGE_COUNTS = [4, 4, 2, 6, 3, 5, 16, 1]


def _update(block_occ: int, subtiles: int):
    def update(state, ids, grad_out, batch_size):
        tiles.fused_update(state, CFG, grad_out, ids, batch_size, block_occ=block_occ, subtiles=subtiles)

    return update


def _grad(batch, grad_out, block_occ: int, subtiles: int) -> torch.Tensor:
    _, grad = tiles.embedding_bag_backward(
        grad_out, batch.ids, batch.batch_size, block_occ=block_occ, subtiles=subtiles
    )
    return grad


def _check_update(batch, optimizer: str, dim: int, dtype: torch.dtype, block_occ: int, subtiles: int) -> None:
    got = make_state(optimizer, batch, dim, dtype)
    want = copy_state(got)
    two_steps(_update(block_occ, subtiles), got, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert_states_close(got, want, dtype)


@pytest.mark.parametrize("subtiles", [1, 2, 4])
@pytest.mark.parametrize("block_occ", [4, 8])
def test_gradient_store_equals_float64_row_sums_for_any_chunks_per_program(block_occ, subtiles):
    """MODE 3; Zipf ids of a 2-row table put hot rows across chunk and span edges."""
    batch = make_batch([2, 30, 7], batch_size=8, max_len=5, mean=True, weighted=True, zipf=True, seed=13)
    dim = 12
    grad_out = batch.grad_out(dim, seed=1)
    rows = torch.unique(batch.ids.rows)
    want = float64_row_grads(batch, grad_out)[rows].float()
    torch.testing.assert_close(_grad(batch, grad_out, block_occ, subtiles), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("subtiles", [1, 2, 4])
@pytest.mark.parametrize("block_occ", [4, 8])
def test_fused_update_with_several_chunks_per_program_matches_reference(optimizer, block_occ, subtiles):
    batch = make_batch([2, 30, 7], batch_size=8, max_len=4, mean=True, weighted=True, zipf=True, seed=5)
    _check_update(batch, optimizer, 10, torch.float32, block_occ, subtiles)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sixteen_bit_rows_with_four_chunks_per_program_match_reference(optimizer, dtype):
    batch = make_batch([2, 20], batch_size=8, max_len=4, weighted=True, zipf=True, seed=17)
    _check_update(batch, optimizer, 16, {**DTYPES, "fp16": torch.float16}[dtype], 4, 4)


@pytest.mark.parametrize("subtiles", [2, 4])
def test_segments_ending_exactly_on_chunk_and_program_edges(subtiles):
    batch = sorted_rows_batch(EDGE_COUNTS)
    dim = 6
    grad_out = batch.grad_out(dim, seed=6)
    want = float64_row_grads(batch, grad_out).float()
    torch.testing.assert_close(_grad(batch, grad_out, 4, subtiles), want, rtol=1e-5, atol=1e-6)
    for optimizer in OPTIMIZERS:
        _check_update(batch, optimizer, dim, torch.float32, 4, subtiles)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_hot_row_across_more_programs_than_one_fixup_step(optimizer, monkeypatch):
    """Row 0's 300 occurrences cover ~18 spans of 16 (more than a fix-up step of 16, shrunk
    from D=8's 128), 37 more rows of one occurrence leave 353 = 22 * 16 + 1: the last span
    holds one occurrence and three chunks without any."""
    monkeypatch.setattr(tiles, "partials_per_step", lambda block_d: 16)
    counts = [300, 15] + [1] * 38
    assert sum(counts) % 16 == 1 and 300 // 16 > 16
    batch = sorted_rows_batch(counts)
    dim = 8
    grad_out = batch.grad_out(dim, seed=4)
    want = float64_row_grads(batch, grad_out).float()
    torch.testing.assert_close(_grad(batch, grad_out, 4, 4), want, rtol=1e-5, atol=1e-5)
    _check_update(batch, optimizer, dim, torch.float32, 4, 4)


@pytest.mark.parametrize("subtiles", [1, 4])
def test_a_single_occurrence(subtiles):
    batch = sorted_rows_batch([0, 1, 0])
    dim = 5
    grad_out = batch.grad_out(dim, seed=2)
    assert torch.equal(_grad(batch, grad_out, 4, subtiles), grad_out[0, 0][None, :].float())
    for optimizer in OPTIMIZERS:
        _check_update(batch, optimizer, dim, torch.float32, 4, subtiles)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_runs_with_several_chunks_per_program_are_bitwise_identical(optimizer, dtype):
    batch = make_batch([2, 40], batch_size=16, max_len=4, mean=True, weighted=True, zipf=True, seed=11)
    dim = 20
    first = make_state(optimizer, batch, dim, DTYPES[dtype])
    second = copy_state(first)
    two_steps(_update(4, 4), first, batch, dim)
    two_steps(_update(4, 4), second, batch, dim)
    assert torch.equal(first.weight, second.weight)
    for key, value in first.states.items():
        assert torch.equal(second.states[key], value), key
    grad_out = batch.grad_out(dim, seed=3)
    assert torch.equal(_grad(batch, grad_out, 4, 4), _grad(batch, grad_out, 4, 4))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_chunks_per_program_change_no_bit_when_no_row_crosses_a_chunk_edge(optimizer):
    """Rows of 4, 2+2 and 1s within chunks of 4: each chunk's scan is the same whatever
    the span, and no carry or partial joins in, so every SUBTILES gives the same bits."""
    batch = sorted_rows_batch([4, 2, 2, 4, 1, 1, 1, 1, 3])
    dim = 7
    grad_out = batch.grad_out(dim, seed=8)
    one = _grad(batch, grad_out, 4, 1)
    states = []
    for subtiles in (1, 2, 4):
        assert torch.equal(_grad(batch, grad_out, 4, subtiles), one), subtiles
        state = make_state(optimizer, batch, dim, torch.bfloat16)
        two_steps(_update(4, subtiles), state, batch, dim)
        states.append(state)
    for state in states[1:]:
        assert torch.equal(state.weight, states[0].weight)
        for key, value in states[0].states.items():
            assert torch.equal(state.states[key], value), key


def test_one_chunk_per_program_is_the_default_launch():
    """The heuristic default (no tuned device) keeps one chunk per program, bit for bit."""
    assert tiles.tile_config(24).subtiles == 1
    batch = make_batch([2, 30, 7], batch_size=8, max_len=4, mean=True, weighted=True, zipf=True, seed=5)
    grad_out = batch.grad_out(24, seed=1)
    block_occ = tiles.tile_config(24).block_occ
    _, default = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size)
    assert torch.equal(default, _grad(batch, grad_out, block_occ, 1))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("subtiles", [4, 16])
def test_gpu_multi_chunk_programs_at_criteo_size_match_reference_and_rerun_bitwise(subtiles):
    """B=65536 one-id bags over a 3-row and a 4-row table (hot rows of ~36k occurrences)
    and 24 Zipf tables of 100k rows, D=128, chunks of 8: two row-wise Adagrad steps match
    the reference backend's update and a second run is bitwise equal."""
    batch = make_batch([3, 4] + [100_000] * 24, batch_size=65536, min_len=1, max_len=1, zipf=True, seed=21)
    dim = 128
    first = make_state("rowwise_adagrad", batch, dim, torch.float32)
    second, want = copy_state(first), copy_state(first)
    two_steps(_update(8, subtiles), first, batch, dim)
    two_steps(_update(8, subtiles), second, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert torch.equal(first.weight, second.weight)
    assert torch.equal(first.states["momentum1"], second.states["momentum1"])
    assert _rel(first.weight, want.weight) < 1e-5
    assert _rel(first.states["momentum1"], want.states["momentum1"]) < 1e-5


@pytest.mark.parametrize(("block_occ", "subtiles"), [(4, 0), (6, 2), (0, 1)])
def test_a_tile_config_the_kernel_cannot_take_is_a_one_line_config_error(block_occ, subtiles):
    batch = sorted_rows_batch([3, 2])
    grad_out = batch.grad_out(4, seed=0)
    with pytest.raises(ConfigError, match=rf"block_occ={block_occ}, subtiles={subtiles}: ") as err:
        _grad(batch, grad_out, block_occ, subtiles)
    assert "\n" not in str(err.value)
