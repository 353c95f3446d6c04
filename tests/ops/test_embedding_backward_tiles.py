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

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import textwrap

import pytest

from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding.optimizers import PackState, init_states
from recaccel.ops.embedding.packing import LocalFeatures, PackIds, gather_pack_ids
from recaccel.ops.embedding.prepared import PreparedPack
from recaccel.ops.embedding.reference import fused_backward
from recaccel.ops.embedding.row_groups import group_by_row
from recaccel.ops.embedding.specs import SparseOptimConfig
from recaccel.sparse import SparseFeatures
from tests.helpers.ops_inputs import compile_in_subprocess

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)

from recaccel.ops.embedding.triton import backward as tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = SparseOptimConfig(lr=0.1, eps=1e-3, weight_decay=0.01)
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adam"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDING_SEED = 12345


class Batch:
    """One pack's occurrences with their output gradient.

    Attributes:
        ids: The pack's ids with bags and per-id scales (weights, ``1/L`` for mean).
        num_rows: R, the pack's rows (tables stacked).
        batch_size: B.
        num_local: S.
    """

    def __init__(self, ids: PackIds, num_rows: int, batch_size: int, num_local: int) -> None:
        self.ids, self.num_rows, self.batch_size, self.num_local = ids, num_rows, batch_size, num_local

    def grad_out(self, dim: int, seed: int) -> torch.Tensor:
        # Drawn on the device: at criteo size ([65536, 26, 128]) a host draw and copy costs
        # seconds of a short GPU loan; on the CPU the values are the ones a CPU draw gives.
        g = torch.Generator(DEVICE).manual_seed(seed)
        return torch.randn(self.batch_size, self.num_local, dim, generator=g, device=DEVICE)


def _zipf(num_rows: int, count: int, gen: torch.Generator, alpha: float = 1.05) -> torch.Tensor:
    """``count`` ids of a table of ``num_rows`` rows, row ``k`` drawn with weight ``1/(k+1)^alpha``."""
    p = 1.0 / torch.arange(1, num_rows + 1, dtype=torch.float64) ** alpha
    return torch.multinomial(p, count, replacement=True, generator=gen)


def _batch(
    table_rows: list[int],
    batch_size: int,
    max_len: int,
    *,
    min_len: int = 0,
    mean: bool = False,
    weighted: bool = False,
    zipf: bool = False,
    seed: int = 0,
) -> Batch:
    """One feature per table, bag lengths uniform in [min_len, max_len], ids uniform or Zipf; the
    pack's ids as the lookup prepares them (:func:`gather_pack_ids`)."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(len(table_rows))]
    lengths = torch.randint(min_len, max_len + 1, (len(keys) * batch_size,), generator=gen)
    values = []
    for f, rows in enumerate(table_rows):
        n = int(lengths[f * batch_size : (f + 1) * batch_size].sum())
        values.append(_zipf(rows, n, gen) if zipf else torch.randint(0, rows, (n,), generator=gen))
    ids = torch.cat(values)
    weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    sf = SparseFeatures.from_lengths(keys, ids, lengths, weights).to(DEVICE)
    offsets = [sum(table_rows[:i]) for i in range(len(table_rows))]
    local = LocalFeatures.build(
        list(range(len(keys))), offsets, [mean] * len(keys), len(keys), torch.device(DEVICE)
    )
    pack_ids = gather_pack_ids(sf, local, batch_size, with_bags=True)
    return Batch(pack_ids, sum(table_rows), batch_size, len(keys))


def _sorted_rows_batch(counts: list[int]) -> Batch:
    """Row ``r`` occurs ``counts[r]`` times (one feature of sum-pooled bags of one id each,
    in shuffled bag order), so the row-sorted segments have exactly these lengths."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    batch_size = rows.numel()
    lengths = torch.ones(batch_size, dtype=torch.int64)
    sf = SparseFeatures.from_lengths(["f"], rows, lengths).to(DEVICE)
    local = LocalFeatures.build([0], [0], [False], 1, torch.device(DEVICE))
    return Batch(gather_pack_ids(sf, local, batch_size, with_bags=True), len(counts), batch_size, 1)


def _float64_row_grads(batch: Batch, grad_out: torch.Tensor) -> torch.Tensor:
    """[R, D] float64: each row's summed occurrence gradients, by ``index_add_``."""
    ids, b = batch.ids, batch.batch_size
    contrib = grad_out.double()[ids.bags % b, ids.bags // b]
    if ids.scale is not None:
        contrib = contrib * ids.scale.double()[:, None]
    out = torch.zeros(batch.num_rows, grad_out.shape[2], dtype=torch.float64, device=grad_out.device)
    return out.index_add_(0, ids.rows, contrib)


def _state(optimizer: str, batch: Batch, dim: int, dtype: torch.dtype, seed: int = 3) -> PackState:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    weight = torch.randn(batch.num_rows, dim, generator=gen, device=DEVICE).to(dtype)
    sixteen_bit = dtype != torch.float32
    return PackState(
        optimizer,
        weight,
        init_states(optimizer, batch.num_rows, dim, torch.device(DEVICE)),
        torch.zeros((), dtype=torch.int64),
        (lambda: ROUNDING_SEED) if sixteen_bit else None,
    )


def _copy(state: PackState) -> PackState:
    return PackState(
        state.optimizer,
        state.weight.clone(),
        {k: v.clone() for k, v in state.states.items()},
        state.step.clone(),
        state.rounding_seed,
    )


def _assert_states_close(got: PackState, want: PackState, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got.weight, want.weight, rtol=1e-5, atol=1e-6)
    else:
        # Summation order moves the fp32 value by a few ulps, which can flip a stochastic
        # rounding to the other 16-bit neighbour: within one 16-bit step, mostly the same bits.
        torch.testing.assert_close(got.weight.float(), want.weight.float(), rtol=2.0**-7, atol=1e-6)
        assert (got.weight == want.weight).float().mean() > 0.9
    assert int(got.step) == int(want.step)
    for key, value in want.states.items():
        torch.testing.assert_close(
            got.states[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
        )


def _two_steps(update, state: PackState, batch: Batch, dim: int) -> None:
    """Two updates with different output gradients (Adam's and Adagrad's state carry over)."""
    for step in range(2):
        update(state, batch.ids, batch.grad_out(dim, seed=10 + step), batch.batch_size)


def _tiles_update(block_occ: int | None):
    def update(state, ids, grad_out, batch_size):
        tiles.fused_update(state, CFG, grad_out, ids, batch_size, block_occ=block_occ)

    return update


def _reference_update(state, ids, grad_out, batch_size):
    fused_backward(state, CFG, grad_out, PreparedPack(ids, group_by_row(ids.rows)))


@pytest.mark.parametrize("block_occ", [4, 8, None])
@pytest.mark.parametrize("dim", [5, 48, 100])
def test_gradient_equals_float64_row_sums_for_any_tile_size(dim, block_occ):
    batch = _batch([3, 40, 9], batch_size=6, max_len=5, mean=True, weighted=True, seed=dim)
    grad_out = batch.grad_out(dim, seed=1)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=block_occ)
    torch.testing.assert_close(rows, torch.unique(batch.ids.rows))
    want = _float64_row_grads(batch, grad_out)[rows].float()
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim", [16, 128, 256])
def test_gradient_on_zipf_ids_with_a_two_row_table_equals_float64_row_sums(dim):
    batch = _batch([2, 50], batch_size=8, max_len=6, weighted=True, zipf=True, seed=dim)
    grad_out = batch.grad_out(dim, seed=2)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=8)
    assert torch.equal(rows, torch.unique(batch.ids.rows))
    want = _float64_row_grads(batch, grad_out)[rows].float()
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("block_occ", [4, None])
def test_fused_update_matches_reference_optimizer_on_zipf_ids(optimizer, dtype, block_occ):
    """Zipf ids with a 2-row table (its rows span many tiles of 4), mean pooling and
    weights, duplicate ids within and across bags."""
    batch = _batch([2, 30, 7], batch_size=8, max_len=4, mean=True, weighted=True, zipf=True, seed=5)
    dim = 24
    got = _state(optimizer, batch, dim, DTYPES[dtype])
    want = _copy(got)
    _two_steps(_tiles_update(block_occ), got, batch, dim)
    _two_steps(_reference_update, want, batch, dim)
    _assert_states_close(got, want, DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_update_with_uniform_ids_and_tiles_of_8_matches_reference(optimizer, dtype):
    batch = _batch([3, 20], batch_size=6, max_len=5, weighted=True, seed=9)
    dim = 16
    got = _state(optimizer, batch, dim, DTYPES[dtype])
    want = _copy(got)
    _two_steps(_tiles_update(8), got, batch, dim)
    _two_steps(_reference_update, want, batch, dim)
    _assert_states_close(got, want, DTYPES[dtype])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_row_table_whose_rows_span_more_than_one_fixup_chunk(optimizer):
    """Row 0 takes ~3/4 of 256 occurrences: ~48 tiles of 4, three fix-up chunks of 16."""
    counts = [190, 66]
    batch = _sorted_rows_batch(counts)
    assert sum(counts) // 4 > 2 * tiles.CHUNK_TILES
    dim = 8
    grad_out = batch.grad_out(dim, seed=4)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=4)
    torch.testing.assert_close(grad, _float64_row_grads(batch, grad_out).float(), rtol=1e-5, atol=1e-5)
    got = _state(optimizer, batch, dim, torch.float32)
    want = _copy(got)
    _two_steps(_tiles_update(4), got, batch, dim)
    _two_steps(_reference_update, want, batch, dim)
    _assert_states_close(got, want, torch.float32)


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
    batch = _sorted_rows_batch(counts)
    dim = 6
    grad_out = batch.grad_out(dim, seed=6)
    rows, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=4)
    assert rows.tolist() == list(range(len(counts)))
    torch.testing.assert_close(grad, _float64_row_grads(batch, grad_out).float(), rtol=1e-5, atol=1e-6)
    got = _state("rowwise_adagrad", batch, dim, torch.float32)
    want = _copy(got)
    _two_steps(_tiles_update(4), got, batch, dim)
    _two_steps(_reference_update, want, batch, dim)
    _assert_states_close(got, want, torch.float32)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_empty_batch_counts_the_step_and_leaves_rows_alone(optimizer):
    batch = _batch([3, 5], batch_size=4, max_len=0, seed=1)
    assert batch.ids.rows.numel() == 0
    dim = 8
    state = _state(optimizer, batch, dim, torch.bfloat16)
    drawn = []
    state.rounding_seed = lambda: drawn.append(1) or ROUNDING_SEED
    before = _copy(state)
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
    batch = _batch([2, 40], batch_size=16, max_len=4, mean=True, weighted=True, zipf=True, seed=11)
    dim = 20
    first = _state(optimizer, batch, dim, DTYPES[dtype])
    second = _copy(first)
    _two_steps(_tiles_update(8), first, batch, dim)
    _two_steps(_tiles_update(8), second, batch, dim)
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

    HYPER = {k: "fp32" for k in ("lr", "eps", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "weight_decay", "bias_c1", "bias_c2")}
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
    batch = _batch([3, 4] + [100_000] * 24, batch_size=65536, min_len=1, max_len=1, zipf=True, seed=21)
    dim = 128
    first = _state(optimizer, batch, dim, torch.float32)
    second, want = _copy(first), _copy(first)
    _two_steps(_tiles_update(None), first, batch, dim)
    _two_steps(_tiles_update(None), second, batch, dim)
    _two_steps(_reference_update, want, batch, dim)
    assert torch.equal(first.weight, second.weight)
    assert _rel(first.weight, want.weight) < 1e-5
    for key, value in want.states.items():
        assert torch.equal(first.states[key], second.states[key]), key
        assert _rel(first.states[key], value) < 1e-5, key
