"""The occurrence-tile Triton backward and fused sparse update against the reference.

:mod:`recaccel.ops.embedding.triton.backward` sums each row's occurrence gradients by
fixed-size tiles of row-sorted occurrences and combines the partials of rows that span
tiles in a second kernel. Tiles of 4 or 8 occurrences force hot rows across many tiles
(more than one fix-up chunk of 16 tiles), rows ending exactly on a tile boundary and rows
complete inside one tile. Without CUDA the kernels run under TRITON_INTERPRET=1 (set in
conftest.py before the kernel module is imported) on tiny shapes; the summation order
differs from the reference's, so float32 results agree to a tolerance, 16-bit rows to
one stochastic-rounding step.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from recaccel.ops.embedding.triton import backward as tiles
from tests.helpers.backward_tiles import (
    CFG,
    DTYPES,
    OPTIMIZERS,
    ROUNDING_SEED,
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
from tests.helpers.ops_inputs import compile_in_subprocess

pytestmark = needs_triton


def _tiles_update(block_occ: int | None):
    def update(state, ids, grad_out, batch_size):
        tiles.fused_update(state, CFG, grad_out, ids, batch_size, block_occ=block_occ)

    return update


@pytest.mark.parametrize("block_occ", [4, 8, None])
@pytest.mark.parametrize("dim", [5, 48, 100])
def test_gradient_equals_float64_row_sums_for_any_tile_size(dim, block_occ):
    batch = make_batch([3, 40, 9], batch_size=6, max_len=5, mean=True, weighted=True, seed=dim)
    grad_out = batch.grad_out(dim, seed=1)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=block_occ)
    torch.testing.assert_close(rows, torch.unique(batch.ids.rows))
    want = float64_row_grads(batch, grad_out)[rows].float()
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim", [16, 128, 256])
def test_gradient_on_zipf_ids_with_a_two_row_table_equals_float64_row_sums(dim):
    batch = make_batch([2, 50], batch_size=8, max_len=6, weighted=True, zipf=True, seed=dim)
    grad_out = batch.grad_out(dim, seed=2)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=8)
    assert torch.equal(rows, torch.unique(batch.ids.rows))
    want = float64_row_grads(batch, grad_out)[rows].float()
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("block_occ", [4, None])
def test_fused_update_matches_reference_optimizer_on_zipf_ids(optimizer, dtype, block_occ):
    """Zipf ids with a 2-row table (its rows span many tiles of 4), mean pooling and
    weights, duplicate ids within and across bags."""
    batch = make_batch([2, 30, 7], batch_size=8, max_len=4, mean=True, weighted=True, zipf=True, seed=5)
    dim = 24
    got = make_state(optimizer, batch, dim, DTYPES[dtype])
    want = copy_state(got)
    two_steps(_tiles_update(block_occ), got, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert_states_close(got, want, DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_update_with_uniform_ids_and_tiles_of_8_matches_reference(optimizer, dtype):
    batch = make_batch([3, 20], batch_size=6, max_len=5, weighted=True, seed=9)
    dim = 16
    got = make_state(optimizer, batch, dim, DTYPES[dtype])
    want = copy_state(got)
    two_steps(_tiles_update(8), got, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert_states_close(got, want, DTYPES[dtype])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_row_table_whose_rows_span_more_than_one_fixup_chunk(optimizer, monkeypatch):
    """Row 0 takes ~3/4 of 256 occurrences: ~48 tiles of 4, three fix-up steps of 16 (the
    step shrunk from D=8's 128 so that a small batch walks several)."""
    monkeypatch.setattr(tiles, "partials_per_step", lambda block_d: 16)
    counts = [190, 66]
    batch = sorted_rows_batch(counts)
    assert sum(counts) // 4 > 2 * 16
    dim = 8
    grad_out = batch.grad_out(dim, seed=4)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=4)
    torch.testing.assert_close(grad, float64_row_grads(batch, grad_out).float(), rtol=1e-5, atol=1e-5)
    got = make_state(optimizer, batch, dim, torch.float32)
    want = copy_state(got)
    two_steps(_tiles_update(4), got, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert_states_close(got, want, torch.float32)


@pytest.mark.parametrize(
    "counts",
    [
        [8, 4, 5, 1, 2],  # ends on a boundary after 2 tiles; a whole tile; 1 past a boundary
        [4, 4, 4],  # every row exactly one tile
        [2, 3, 11],  # a row from mid-tile through two whole tiles to the last occurrence
        [1] * 9,  # no row spans: every tile has four complete rows, the last one a single
    ],
)
def test_rows_ending_exactly_on_tile_boundaries(counts):
    batch = sorted_rows_batch(counts)
    dim = 6
    grad_out = batch.grad_out(dim, seed=6)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=4)
    assert rows.tolist() == list(range(len(counts)))
    torch.testing.assert_close(grad, float64_row_grads(batch, grad_out).float(), rtol=1e-5, atol=1e-6)
    got = make_state("rowwise_adagrad", batch, dim, torch.float32)
    want = copy_state(got)
    two_steps(_tiles_update(4), got, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert_states_close(got, want, torch.float32)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_empty_batch_counts_the_step_and_leaves_rows_alone(optimizer):
    batch = make_batch([3, 5], batch_size=4, max_len=0, seed=1)
    assert batch.ids.rows.numel() == 0
    dim = 8
    state = make_state(optimizer, batch, dim, torch.bfloat16)
    drawn = []
    state.rounding_seed = lambda: drawn.append(1) or ROUNDING_SEED
    before = copy_state(state)
    tiles.fused_update(state, CFG, batch.grad_out(dim, seed=0), batch.ids, batch.batch_size)
    assert int(state.step) == 1 and drawn == [1]  # as the reference: one seed per update
    assert torch.equal(state.weight, before.weight)
    for key, value in before.states.items():
        assert torch.equal(state.states[key], value)
    rows, grad = tiles.embedding_bag_backward(batch.grad_out(dim, seed=0), batch.ids, batch.batch_size)
    assert rows.numel() == 0 and grad.shape == (0, dim)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_runs_are_bitwise_identical(optimizer, dtype):
    """No atomics: the same tiles sum in the same order every run, hot rows included."""
    batch = make_batch([2, 40], batch_size=16, max_len=4, mean=True, weighted=True, zipf=True, seed=11)
    dim = 20
    first = make_state(optimizer, batch, dim, DTYPES[dtype])
    second = copy_state(first)
    two_steps(_tiles_update(8), first, batch, dim)
    two_steps(_tiles_update(8), second, batch, dim)
    assert torch.equal(first.weight, second.weight)
    for key, value in first.states.items():
        assert torch.equal(second.states[key], value), key
    grad_out = batch.grad_out(dim, seed=3)
    _, grad_a = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=8)
    _, grad_b = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=8)
    assert torch.equal(grad_a, grad_b)


def test_default_tile_sizes_are_powers_of_two_within_the_register_budget():
    for dim in (1, 16, 48, 100, 128, 256, 1024):
        block_occ, num_warps, subtiles = tiles.tile_config(dim)
        assert block_occ & (block_occ - 1) == 0 and 8 <= block_occ <= 128, dim
        assert dim > 256 or block_occ * max(dim, 16) <= 4096, dim
        assert num_warps == 4 and subtiles == 1


_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from recaccel.ops.embedding.triton import backward as K

    HYPER = {"lr_ptr": "*fp32"} | {k: "fp32" for k in ("eps", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "weight_decay", "bias_c1", "bias_c2")}
    HYPER["seed"] = "i32"
    TILE = {
        "weight_ptr": "*fp32", "m1_ptr": "*fp32", "m2_ptr": "*fp32", "keys_ptr": "*i64",
        "bags_ptr": "*i64", "scale_ptr": "*fp32", "grad_out_ptr": "*fp32", "part_ptr": "*fp32",
        "num_occ": "i32", "batch_size": "i32", "dim": "i32", "stride_w": "i32",
        "stride_gb": "i32", "stride_gf": "i32", "stride_gd": "i32", **HYPER,
        "MODE": "constexpr", "STOCHASTIC": "constexpr", "HAS_SCALE": "constexpr",
        "BLOCK_OCC": "constexpr", "BLOCK_D": "constexpr", "SUBTILES": "constexpr",
    }
    SPAN = {
        "weight_ptr": "*fp32", "m1_ptr": "*fp32", "m2_ptr": "*fp32", "keys_ptr": "*i64",
        "part_ptr": "*fp32", "num_occ": "i32", "num_tiles": "i32", "dim": "i32", "stride_w": "i32",
        **HYPER, "MODE": "constexpr", "STOCHASTIC": "constexpr", "BLOCK_OCC": "constexpr",
        "BLOCK_D": "constexpr", "CHUNK": "constexpr",
    }
    variants = []
    for mode, weight, stochastic in ((0, "*fp32", 0), (1, "*fp32", 0), (2, "*bf16", 1), (3, "*fp32", 0)):
        for subtiles in (1, 4):
            variants.append((K._occurrence_tile_kernel, {**TILE, "weight_ptr": weight},
                             {"MODE": mode, "STOCHASTIC": stochastic, "HAS_SCALE": 1, "BLOCK_OCC": 16,
                              "BLOCK_D": 128, "SUBTILES": subtiles}))
        variants.append((K._spanning_rows_kernel, {**SPAN, "weight_ptr": weight},
                         {"MODE": mode, "STOCHASTIC": stochastic, "BLOCK_OCC": 16, "BLOCK_D": 128,
                          "CHUNK": 16}))
    # The gradient of a bf16 pooled output (mixed precision), read as it is, without scales.
    variants.append((K._occurrence_tile_kernel, {**TILE, "grad_out_ptr": "*bf16"},
                     {"MODE": 1, "STOCHASTIC": 0, "HAS_SCALE": 0, "BLOCK_OCC": 16, "BLOCK_D": 128,
                      "SUBTILES": 16}))
    for fn, signature, constexprs in variants:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
        )
        assert compiled.asm["cubin"], fn
        assert "atom." not in compiled.asm["ptx"], fn  # deterministic: no atomics
    print("compiled", len(variants))
    """
)


def test_tile_kernels_compile_for_sm90_without_atomics(tmp_path):
    """The interpreter never runs Triton's compiler: compile every mode for an H100/H200."""
    done = compile_in_subprocess(_COMPILE, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "compiled 13" in done.stdout


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_gpu_hot_rows_at_criteo_size_match_reference_and_rerun_bitwise(optimizer):
    """Criteo's shape of skew on CUDA: B=65536 one-id bags over a 3-row and a 4-row table
    (~36k and ~32k occurrences of their top rows) and 24 Zipf tables of 100k rows, D=128,
    default tiles: two steps match the reference backend's update (float32 sums in another
    order) and a second run is bitwise equal."""
    batch = make_batch([3, 4] + [100_000] * 24, batch_size=65536, min_len=1, max_len=1, zipf=True, seed=21)
    dim = 128
    first = make_state(optimizer, batch, dim, torch.float32)
    second, want = copy_state(first), copy_state(first)
    two_steps(_tiles_update(None), first, batch, dim)
    two_steps(_tiles_update(None), second, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert torch.equal(first.weight, second.weight)
    assert _rel(first.weight, want.weight) < 1e-5
    for key, value in want.states.items():
        assert torch.equal(first.states[key], second.states[key]), key
        assert _rel(first.states[key], value) < 1e-5, key
