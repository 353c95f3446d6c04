"""The piece-lane backward: segments cut into pieces, lanes summing pieces in order, split
rows finished from partials by the combine kernel.

Checked against float64 row sums (the gradient store) and the reference optimizer (every
sparse optimizer, 32- and 16-bit rows) on tiny shapes under TRITON_INTERPRET=1 (set in
conftest.py): pieces of one occurrence, rows ending exactly on piece edges, a hot row of
more pieces than one combine step loads, more windows than one combine program scans,
odd and power-of-two D, weights and mean pooling; the piece cut against a plain loop;
two runs bitwise equal, and lanes, unroll and warps changing no bit.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from recaccel.errors import ConfigError
from recaccel.ops.embedding.triton import backward as tiles
from recaccel.ops.embedding.triton import piece_lanes, tuning
from recaccel.ops.embedding.triton import pieces as pieces_module
from recaccel.ops.embedding.triton.piece_lanes import LaneConfig
from recaccel.ops.embedding.triton.pieces import build_pieces, reference_pieces
from tests.helpers.backward_tiles import (
    CFG,
    DEVICE,
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
from tests.helpers.ops_inputs import compile_in_subprocess

pytestmark = needs_triton

SMALL = LaneConfig(piece_len=4, block_pieces=4, unroll=1, num_warps=2)
CONFIGS = [
    SMALL,
    LaneConfig(piece_len=2, block_pieces=8, unroll=2, num_warps=4),
    LaneConfig(piece_len=64, block_pieces=16, unroll=3, num_warps=4),
    LaneConfig(piece_len=1, block_pieces=1, unroll=1, num_warps=1),
]


def _grad(batch, grad_out, config: LaneConfig) -> torch.Tensor:
    _, grad = tiles.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, config=config)
    return grad


def _update(config: LaneConfig):
    def update(state, ids, grad_out, batch_size):
        tiles.fused_update(state, CFG, grad_out, ids, batch_size, config=config)

    return update


def _check_update(batch, optimizer: str, dim: int, dtype: torch.dtype, config: LaneConfig) -> None:
    got = make_state(optimizer, batch, dim, dtype)
    want = copy_state(got)
    two_steps(_update(config), got, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert_states_close(got, want, dtype)


def _plain_pieces(keys: list[int], piece_len: int) -> list[int]:
    """Piece starts by a loop: a new piece at a new key or every piece_len of one key."""
    starts, run = [], 0
    for i, key in enumerate(keys):
        run = run + 1 if i and key == keys[i - 1] else 0
        if run % piece_len == 0:
            starts.append(i)
    return starts


@pytest.mark.parametrize("piece_len", [1, 2, 3, 8])
def test_pieces_cut_every_segment_from_its_start(piece_len):
    gen = torch.Generator().manual_seed(piece_len)
    keys = torch.sort(torch.randint(0, 9, (60,), generator=gen)).values
    for dtype in (torch.int32, torch.int64):
        pieces = build_pieces(keys.to(dtype).to(DEVICE), piece_len)
        want = _plain_pieces(keys.tolist(), piece_len)
        assert int(pieces.count) == len(want)
        start = pieces.start.cpu()
        assert start[: len(want)].tolist() == want
        assert (start[len(want) :] == keys.numel()).all()  # every piece past the last is empty


@pytest.mark.parametrize("block", [16, 64])
def test_pieces_over_many_programs_equal_the_whole_array_reference(block, monkeypatch):
    """Blocks of 16 or 64 occurrences: segments (a hot key of hundreds among keys of one)
    start before a block and run through several; every key once; one key; one occurrence."""
    monkeypatch.setattr(pieces_module, "BLOCK", block)
    gen = torch.Generator().manual_seed(block)
    cases = [torch.arange(37), torch.zeros(50, dtype=torch.int64), torch.tensor([4])]
    for _ in range(12):
        counts = torch.randint(1, 6, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
        counts[int(torch.randint(0, counts.numel(), (1,), generator=gen))] = 300  # a Zipf-like hot row
        cases.append(
            torch.repeat_interleave(torch.randint(0, 3, (counts.numel(),), generator=gen).cumsum(0), counts)
        )
    for keys in cases:
        for dtype in (torch.int32, torch.int64):
            k = keys.to(dtype).to(DEVICE)
            for piece_len in (1, 3, 16):
                got, want = build_pieces(k, piece_len), reference_pieces(k, piece_len)
                assert torch.equal(got.count, want.count) and torch.equal(got.start, want.start)
                assert got.start[: int(got.count)].tolist() == _plain_pieces(keys.tolist(), piece_len)


def test_split_pieces_never_share_a_partial_slot():
    """The slot rule 2 * (start // PIECE_LEN) + is_last on random segment lengths."""
    gen = torch.Generator().manual_seed(3)
    for piece_len in (2, 3, 5):
        counts = torch.randint(1, 4 * piece_len, (200,), generator=gen)
        keys = torch.repeat_interleave(torch.arange(200), counts)
        pieces = build_pieces(keys, piece_len)
        starts = pieces.start[: int(pieces.count) + 1].tolist()
        slots = []
        for q in range(int(pieces.count)):
            s, e = starts[q], starts[q + 1]
            opens = s == 0 or keys[s - 1] != keys[s]
            closes = e == keys.numel() or keys[e] != keys[s]
            if not (opens and closes):
                slots.append(2 * (s // piece_len) + int(closes))
        assert slots and len(slots) == len(set(slots)), piece_len


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dim", [5, 48, 100])
def test_gradient_store_equals_float64_row_sums(dim, config):
    """Zipf ids of a 2-row table: hot rows of many pieces beside rows of one."""
    batch = make_batch([2, 30, 7], batch_size=8, max_len=5, mean=True, weighted=True, zipf=True, seed=13)
    grad_out = batch.grad_out(dim, seed=1)
    rows = torch.unique(batch.ids.rows)
    want = float64_row_grads(batch, grad_out)[rows].float()
    torch.testing.assert_close(_grad(batch, grad_out, config), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("config", CONFIGS[:2], ids=str)
def test_fused_update_matches_reference_optimizer_on_zipf_ids(config, optimizer, dtype):
    batch = make_batch([2, 30, 7], batch_size=8, max_len=4, mean=True, weighted=True, zipf=True, seed=5)
    _check_update(batch, optimizer, 16, {**DTYPES, "fp16": torch.float16}[dtype], config)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_rows_ending_exactly_on_piece_edges(optimizer):
    """With pieces of 4: rows of exactly 4, 8 and 12 (whole pieces only), 5 (a piece of
    one), 1 and 3."""
    batch = sorted_rows_batch([4, 8, 1, 12, 5, 3, 4])
    dim = 6
    grad_out = batch.grad_out(dim, seed=6)
    want = float64_row_grads(batch, grad_out).float()
    torch.testing.assert_close(_grad(batch, grad_out, SMALL), want, rtol=1e-5, atol=1e-6)
    _check_update(batch, optimizer, dim, torch.float32, SMALL)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_hot_rows_over_more_pieces_and_windows_than_one_combine_step(optimizer):
    """Pieces of 2: row 0's 301 occurrences are 151 pieces (more than one combine step
    loads at D=8), and 700 occurrences are 350 windows (more than COMBINE_WINDOWS per
    program)."""
    counts = [301, 2, 3] + [1] * 30 + [200, 163]
    config = LaneConfig(piece_len=2, block_pieces=8, unroll=1, num_warps=2)
    assert 301 // 2 > piece_lanes.partials_per_step(8) and sum(counts) // 2 > piece_lanes.COMBINE_WINDOWS
    batch = sorted_rows_batch(counts)
    dim = 8
    grad_out = batch.grad_out(dim, seed=4)
    want = float64_row_grads(batch, grad_out).float()
    torch.testing.assert_close(_grad(batch, grad_out, config), want, rtol=1e-5, atol=1e-5)
    _check_update(batch, optimizer, dim, torch.float32, config)


def test_a_single_occurrence_is_its_gradient_row():
    batch = sorted_rows_batch([0, 1, 0])
    grad_out = batch.grad_out(5, seed=2)
    assert torch.equal(_grad(batch, grad_out, SMALL), grad_out[0, 0][None, :].float())
    for optimizer in OPTIMIZERS:
        _check_update(batch, optimizer, 5, torch.float32, SMALL)


def test_a_row_of_one_piece_is_summed_in_order_as_a_sequential_loop():
    """A piece sums its occurrences one by one in sorted order: bitwise a float32 loop."""
    batch = make_batch([3, 5], batch_size=16, max_len=3, weighted=True, seed=9)
    grad_out = batch.grad_out(12, seed=2)
    got = _grad(batch, grad_out, LaneConfig(piece_len=1000, block_pieces=4, unroll=2, num_warps=2))
    ids, b = batch.ids, batch.batch_size
    order = torch.sort(ids.rows, stable=True).indices
    want = torch.zeros(int(ids.rows.max()) + 1, 12, device=grad_out.device)
    for i in order.tolist():
        want[ids.rows[i]] += grad_out[ids.bags[i] % b, ids.bags[i] // b] * ids.scale[i]
    assert torch.equal(got, want[torch.unique(ids.rows)])


def _bits_of(configs, optimizer: str, dtype: torch.dtype) -> None:
    """Asserts that two steps with each of ``configs`` give the same bits."""
    batch = make_batch([2, 40], batch_size=16, max_len=4, mean=True, weighted=True, zipf=True, seed=11)
    dim = 20
    states = []
    for config in configs:
        state = make_state(optimizer, batch, dim, dtype)
        two_steps(_update(config), state, batch, dim)
        states.append(state)
    for state in states[1:]:
        assert torch.equal(state.weight, states[0].weight)
        for key, value in states[0].states.items():
            assert torch.equal(state.states[key], value), key


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_runs_are_bitwise_equal_and_unroll_changes_no_bit(optimizer, dtype):
    configs = [LaneConfig(3, 4, 1, 2), LaneConfig(3, 4, 1, 2), LaneConfig(3, 4, 3, 2), LaneConfig(3, 4, 2, 2)]
    _bits_of(configs, optimizer, DTYPES[dtype])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_lanes_and_warps_change_no_bit_of_elementwise_updates(optimizer):
    """SGD and Adam update each element alone; row-wise Adagrad's sum of g^2 over D is
    reduced in the block's thread layout, which lanes and warps set (on a GPU, its last bit
    may differ between configurations, never between runs)."""
    configs = [LaneConfig(3, 4, 1, 2), LaneConfig(3, 16, 3, 4), LaneConfig(3, 1, 2, 1)]
    _bits_of(configs, optimizer, torch.bfloat16)


def test_a_tuned_entry_with_piece_len_launches_the_lanes(monkeypatch):
    entry = {"piece_len": 32, "block_pieces": 16, "unroll": 2, "num_warps": 8}
    monkeypatch.setattr(tuning, "lookup", lambda device, key: dict(entry))
    assert tiles.tile_config(128, torch.float32, "cpu") == LaneConfig(32, 16, 2, 8)
    # Tile fields asked for by name still get the occurrence tiles.
    config = tiles.resolve_config(128, torch.float32, torch.device("cpu"), None, 8, None, None)
    assert config == tiles.TileConfig(8, tiles.tile_config(128).num_warps, 1)


@pytest.mark.parametrize("config", [LaneConfig(0, 4, 1, 2), LaneConfig(4, 6, 1, 2), LaneConfig(4, 4, 0, 2)])
def test_a_lane_config_the_kernel_cannot_take_is_a_one_line_config_error(config):
    batch = sorted_rows_batch([3, 2])
    grad_out = batch.grad_out(4, seed=0)
    with pytest.raises(ConfigError, match="piece-lane backward") as err:
        _grad(batch, grad_out, config)
    assert "\n" not in str(err.value)


_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from recaccel.ops.embedding.triton import piece_lanes as K

    HYPER = {"lr_ptr": "*fp32"} | {k: "fp32" for k in ("eps", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2",
                                 "weight_decay", "bias_c1", "bias_c2")}
    HYPER["seed"] = "i32"
    LANES = {
        "weight_ptr": "*fp32", "m1_ptr": "*fp32", "m2_ptr": "*fp32", "keys_ptr": "*i32",
        "bags_ptr": "*i64", "scale_ptr": "*fp32", "grad_out_ptr": "*fp32", "piece_start_ptr": "*i64",
        "num_pieces_ptr": "*i64", "part_ptr": "*fp32", "owner_ptr": "*i64", "num_occ": "i32",
        "batch_size": "i32", "dim": "i32", "stride_w": "i32", "stride_gb": "i32", "stride_gf": "i32",
        "stride_gd": "i32", **HYPER, "MODE": "constexpr", "STOCHASTIC": "constexpr",
        "HAS_SCALE": "constexpr", "PIECE_LEN": "constexpr", "BLOCK_PIECES": "constexpr",
        "BLOCK_D": "constexpr", "UNROLL": "constexpr",
    }
    COMBINE = {
        "weight_ptr": "*fp32", "m1_ptr": "*fp32", "m2_ptr": "*fp32", "keys_ptr": "*i32",
        "part_ptr": "*fp32", "owner_ptr": "*i64", "num_occ": "i32", "num_windows": "i32",
        "dim": "i32", "stride_w": "i32", **HYPER, "MODE": "constexpr", "STOCHASTIC": "constexpr",
        "PIECE_LEN": "constexpr", "BLOCK_D": "constexpr", "CHUNK": "constexpr", "WINDOWS": "constexpr",
    }
    variants = []
    for mode, weight, stochastic in ((0, "*fp32", 0), (1, "*fp32", 0), (2, "*bf16", 1), (3, "*fp32", 0)):
        for lanes, unroll in ((16, 1), (32, 2)):
            variants.append((K._piece_lanes_kernel, {**LANES, "weight_ptr": weight},
                             {"MODE": mode, "STOCHASTIC": stochastic, "HAS_SCALE": 1, "PIECE_LEN": 64,
                              "BLOCK_PIECES": lanes, "BLOCK_D": 128, "UNROLL": unroll}))
        variants.append((K._piece_combine_kernel, {**COMBINE, "weight_ptr": weight},
                         {"MODE": mode, "STOCHASTIC": stochastic, "PIECE_LEN": 64, "BLOCK_D": 128,
                          "CHUNK": 64, "WINDOWS": 128}))
    for fn, signature, constexprs in variants:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
        )
        assert compiled.asm["cubin"], fn
        assert "atom." not in compiled.asm["ptx"], fn  # deterministic: no atomics
    print("compiled", len(variants))
    """
)


def test_lane_kernels_compile_for_sm90_without_atomics(tmp_path):
    """The interpreter never runs Triton's compiler: compile every mode for an H100/H200
    (Triton 3.6's layout pass once failed on 32 lanes: the lanes' vectors are columns)."""
    done = compile_in_subprocess(_COMPILE, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "compiled 12" in done.stdout


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [LaneConfig(64, 16, 1, 8), LaneConfig(32, 32, 2, 8)], ids=str)
def test_gpu_lanes_at_criteo_size_match_reference_and_rerun_bitwise(config):
    """B=65536 one-id bags over a 3-row and a 4-row table (hot rows of ~36k occurrences:
    hundreds of pieces each) and 24 Zipf tables of 100k rows, D=128: two row-wise Adagrad
    steps match the reference backend's update and a second run is bitwise equal."""
    batch = make_batch([3, 4] + [100_000] * 24, batch_size=65536, min_len=1, max_len=1, zipf=True, seed=21)
    dim = 128
    first = make_state("rowwise_adagrad", batch, dim, torch.float32)
    second, want = copy_state(first), copy_state(first)
    two_steps(_update(config), first, batch, dim)
    two_steps(_update(config), second, batch, dim)
    two_steps(reference_update, want, batch, dim)
    assert torch.equal(first.weight, second.weight)
    assert torch.equal(first.states["momentum1"], second.states["momentum1"])
    assert _rel(first.weight, want.weight) < 1e-5
    assert _rel(first.states["momentum1"], want.states["momentum1"]) < 1e-5
    assert DEVICE == "cuda"


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_any_number_of_programs_gives_the_same_bits(programs, monkeypatch):
    """Programs loop over the blocks of pieces: how many there are changes no bit."""
    batch = make_batch([2, 40], batch_size=16, max_len=4, mean=True, weighted=True, zipf=True, seed=12)
    grad_out = batch.grad_out(10, seed=5)
    want = _grad(batch, grad_out, SMALL)
    monkeypatch.setattr(piece_lanes.LANE_GRID, "programs", lambda *args: programs)
    assert torch.equal(_grad(batch, grad_out, SMALL), want)


def test_the_grid_is_one_resident_wave_once_the_kernel_tells_its_registers():
    class Compiled:  # what a launch returns on CUDA: the compiled kernel's register count
        n_regs = 126

    grid = piece_lanes.LaneGrid()
    config = LaneConfig(32, 16, 1, 4)
    # 126 registers x 128 threads: 4 programs per SM; 255 x 256: 1; the thread limit caps small ones.
    assert piece_lanes._programs_per_sm(126, 4) == 4
    assert piece_lanes._programs_per_sm(255, 8) == 1
    assert piece_lanes._programs_per_sm(16, 1) == piece_lanes.SM_THREADS // 32
    grid.learn("sig", Compiled(), config)
    grid.learn("sig", type("Later", (), {"n_regs": 40})(), config)  # the first compile's count stays
    assert grid._per_sm == {"sig": 4}
    grid.learn("interpreted", None, config)
    assert "interpreted" not in grid._per_sm
    cpu = torch.device("cpu")
    assert grid.programs("sig", 10_000, config, cpu) == 4  # the interpreter: at most 4 programs
    assert grid.programs("sig", 20, config, cpu) == 2  # never more than the blocks of pieces


@pytest.mark.parametrize("dim", [16, 128, 256])
def test_one_300_id_bag_among_short_ones_at_wide_dims(dim):
    """Bag 0 of feature 0 holds 300 ids of a 50-row table (rows of ~6 occurrences from one
    bag, several pieces each at piece_len 2), beside bags of 0-2 ids."""
    from recaccel.ops.embedding.packing import LocalFeatures, gather_pack_ids
    from recaccel.sparse import SparseFeatures
    from tests.helpers.backward_tiles import Batch

    gen = torch.Generator().manual_seed(dim)
    lengths = torch.cat([torch.tensor([300]), torch.randint(0, 3, (7,), generator=gen)])
    ids = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    sf = SparseFeatures.from_lengths(["f", "g"], ids, lengths, torch.rand(ids.numel(), generator=gen)).to(
        DEVICE
    )
    local = LocalFeatures.build([0, 1], [0, 0], [True, False], 2, torch.device(DEVICE))
    batch = Batch(gather_pack_ids(sf, local, 4, with_bags=True), 50, 4, 2)
    grad_out = batch.grad_out(dim, seed=7)
    rows = torch.unique(batch.ids.rows)
    want = float64_row_grads(batch, grad_out)[rows].float()
    config = LaneConfig(piece_len=2, block_pieces=8, unroll=2, num_warps=4)
    torch.testing.assert_close(_grad(batch, grad_out, config), want, rtol=1e-5, atol=1e-5)
    _check_update(batch, "rowwise_adagrad", dim, torch.float32, config)
