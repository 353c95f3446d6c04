"""The kernel sweep's piece-lane backward candidates and their way into the tuning table.

The sweep times the piece lanes beside the occurrence tiles on every backward case; a
lane winner is written with its four fields (``piece_len`` marks it) and the launch then
runs the lanes for that device and shape.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.bench.kernels import sweep as kernels
from recaccel.bench.kernels import sweep_cases
from recaccel.ops.backend import triton_interpret_enabled

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)

from recaccel.ops.embedding.triton import backward, tuning  # noqa: E402
from recaccel.ops.embedding.triton.piece_lanes import LaneConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FAKE_GPU = "NVIDIA Test GPU"


@pytest.mark.parametrize(
    ("dim", "shapes"), [(128, {(16, 4), (32, 8)}), (32, {(64, 4), (128, 8)}), (256, {(8, 4), (16, 8)})]
)
def test_lane_candidates_hold_sixteen_sums_per_thread_at_four_and_eight_warps(dim, shapes):
    case = sweep_cases.KernelCase("backward", 26, 16384, dim, 20, "float32", zipf=True)
    lanes = sweep_cases.lane_sweep(case)
    assert {(f["block_pieces"], f["num_warps"]) for f in lanes} == shapes
    assert {f["piece_len"] for f in lanes} == set(sweep_cases.PIECE_LENS)
    assert {f["unroll"] for f in lanes} == {1, 2}
    assert all(f in sweep_cases.backward_sweep(case) for f in lanes)
    names = [sweep_cases.config_name(f) for f in sweep_cases.backward_sweep(case)]
    assert "pl32_bp16_u1_w4" in names or dim != 128
    assert len(set(names)) == len(names)


def test_lane_candidates_run_and_match_the_default_output(monkeypatch):
    """On the CPU case: every lane config updates the same rows as the tile default within
    the sweep's tolerance (another summation order), so it would be timed."""
    case = sweep_cases.CPU_CASES[1]
    monkeypatch.setattr(tuning, "_load_table", lambda: {})
    candidates, _ = sweep_cases.backward_candidates(case, DEVICE)
    lanes = [name for name, c in candidates.items() if "piece_len" in c.fields]
    assert len(lanes) == len(sweep_cases.lane_sweep(case))
    want = candidates["default"].run()
    for name in lanes:
        assert kernels._check(candidates[name], want, case) is None, name


def test_lane_winner_is_written_with_its_fields_and_read_back_by_the_launch(tmp_path, monkeypatch):
    lane = {"piece_len": 4, "block_pieces": 8, "unroll": 2, "num_warps": 4}
    record = {
        "key": tuning.backward_key(48, "float32"),
        "best": "pl4_bp8_u2_w4",
        "case": {"kernel": "backward"},
        "configs": {
            "default": {"ms": 2.0, "block_occ": 8, "num_warps": 4},
            "pl4_bp8_u2_w4": {"ms": 1.0, **lane},
        },
    }
    assert kernels.winners([record]) == {record["key"]: lane}
    path = tuning.write_table(tmp_path / "table.py", FAKE_GPU, kernels.winners([record]))
    monkeypatch.setattr(tuning, "_load_table", lambda: tuning.read_table(path))
    monkeypatch.setattr(tuning, "device_name", lambda device: FAKE_GPU)
    assert backward.tile_config(48, torch.float32, DEVICE) == LaneConfig(4, 8, 2, 4)
    from tests.helpers.backward_tiles import sorted_rows_batch

    batch = sorted_rows_batch([9, 1, 4, 7])
    grad_out = batch.grad_out(48, seed=3)
    _, got = backward.embedding_bag_backward(grad_out, batch.ids, batch.batch_size)
    _, lanes = backward.embedding_bag_backward(
        grad_out, batch.ids, batch.batch_size, config=LaneConfig(4, 8, 2, 4)
    )
    assert torch.equal(got, lanes)


def test_backward_cases_are_keyed_by_their_density_bucket():
    """Occurrences per row decide the winner: L=1 and L=20 cases of one D get their own keys."""
    keys = {
        case.name: kernels.shape_key(case) for case in sweep_cases.gpu_cases() if case.kernel == "backward"
    }
    assert keys["bwd_T26_B16384_D128_L1_zipf_float32"] == "bwd_D128_N1_float32"
    assert keys["bwd_T26_B16384_D128_L20_zipf_float32"] == "bwd_D128_N32_float32"
    assert keys["bwd_T26_B65536_D128_L1_zipf_float32"] == "bwd_D128_N4_float32"
    assert (
        tuning.backward_key(128, torch.float32) == "bwd_D128_float32"
    )  # old tables: every bucket's fallback


def test_backward_winners_also_fill_the_bucketless_key_from_every_bucket():
    lane = {"piece_len": 32, "block_pieces": 16, "unroll": 1, "num_warps": 4}
    tile = {"block_occ": 8, "num_warps": 2}

    def record(density: int, lane_ms: float, tile_ms: float) -> dict:
        return {
            "key": tuning.backward_key(128, "float32", density),
            "case": {"kernel": "backward", "dim": 128, "dtype": "float32"},
            "configs": {"lanes": {"ms": lane_ms, **lane}, "tiles": {"ms": tile_ms, **tile}},
            "best": "lanes" if lane_ms < tile_ms else "tiles",
        }

    won = kernels.winners([record(1, 2.0, 1.0), record(32, 1.0, 5.0)])
    assert won["bwd_D128_N1_float32"] == tile and won["bwd_D128_N32_float32"] == lane
    # Together: lanes 2x / 1x of each case's best, tiles 1x / 5x: the lanes.
    assert won["bwd_D128_float32"] == lane
