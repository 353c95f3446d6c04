"""The kernel sweep's multi-chunk backward candidates and their way into the tuning table.

The sweep tries programs of 4 and 16 chunks around the device's tuned one-chunk config
(or the heuristic default); a winner with more than one chunk is written with its
``subtiles``, a one-chunk winner without it, and the launch reads either back.
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

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FAKE_GPU = "NVIDIA Test GPU"
D128 = sweep_cases.KernelCase("backward", 26, 16384, 128, 20, "float32", zipf=True)


def _multi_chunk(configs: list[dict[str, int]]) -> list[dict[str, int]]:
    return [f for f in configs if f.get("subtiles", 1) > 1]


def test_multi_chunk_candidates_surround_the_tuned_config_and_stay_few():
    tiles = sweep_cases.tile_sweep(D128, {"block_occ": 8, "num_warps": 2})
    assert _multi_chunk(tiles) == [
        {"block_occ": 8, "num_warps": w, "subtiles": s} for w in (2, 4) for s in sweep_cases.SUBTILES
    ]
    assert sweep_cases.SUBTILES == (4, 16)
    # A tuned device refines around its one-chunk winner: that one config, then the 4.
    assert tiles[0] == {"block_occ": 8, "num_warps": 2} and len(tiles) == 5
    untuned = sweep_cases.tile_sweep(D128)
    # Untuned: every one-chunk config, then the default (4 warps) in 4 and 16 chunks.
    assert len([f for f in untuned if "subtiles" not in f]) > 4 and len(_multi_chunk(untuned)) == 2
    # A lane entry as the tuned one leaves the tiles' full sweep.
    assert (
        sweep_cases.tile_sweep(D128, {"piece_len": 32, "block_pieces": 16, "unroll": 1, "num_warps": 4})
        == untuned
    )
    default = backward.tile_config(128)
    assert {(f["block_occ"], f["num_warps"]) for f in _multi_chunk(sweep_cases.backward_sweep(D128))} == {
        (default.block_occ, 4)
    }
    names = [
        sweep_cases.config_name(f) for f in sweep_cases.backward_sweep(D128, {"block_occ": 8, "num_warps": 2})
    ]
    assert "occ8_w2_st16" in names and len(set(names)) == len(names)


def test_multi_chunk_candidate_runs_and_matches_the_default_output(monkeypatch):
    """On the CPU case: the candidate updates the same rows as the one-chunk default,
    within the sweep's own tolerance (another summation order), so it would be timed."""
    case = sweep_cases.CPU_CASES[1]
    monkeypatch.setattr(tuning, "_load_table", lambda: {})
    candidates, _ = sweep_cases.backward_candidates(case, DEVICE)
    multi = [name for name, c in candidates.items() if c.fields.get("subtiles", 1) > 1]
    assert len(multi) >= 2
    want = candidates["default"].run()
    for name in multi:
        assert kernels._check(candidates[name], want, case) is None, name
        got = candidates[name].run()
        assert not torch.equal(got, torch.zeros_like(got))


def _record(best: str, configs: dict[str, dict]) -> dict:
    timed = {name: {"ms": ms, **fields} for name, (ms, fields) in configs.items()}
    return {"key": tuning.backward_key(48, "float32"), "best": best, "configs": timed,
            "case": {"kernel": "backward"}}  # fmt: skip


def test_multi_chunk_winner_is_written_with_subtiles_and_read_back_by_the_launch(tmp_path, monkeypatch):
    multi = {"block_occ": 4, "num_warps": 2, "subtiles": 16}
    record = _record(
        "occ4_w2_st16", {"default": (2.0, {"block_occ": 8, "num_warps": 4}), "occ4_w2_st16": (1.0, multi)}
    )
    key = record["key"]
    assert kernels.winners([record]) == {key: multi}
    one = _record(
        "occ8_w4", {"occ8_w4": (1.0, {"block_occ": 8, "num_warps": 4}), "occ4_w2_st16": (3.0, multi)}
    )
    assert kernels.winners([one]) == {key: {"block_occ": 8, "num_warps": 4}}  # no "subtiles": 1

    path = tuning.write_table(tmp_path / "table.py", FAKE_GPU, kernels.winners([record]))
    monkeypatch.setattr(tuning, "_load_table", lambda: tuning.read_table(path))
    monkeypatch.setattr(tuning, "device_name", lambda device: FAKE_GPU)
    assert backward.tile_config(48, torch.float32, DEVICE) == (4, 2, 16)
    # The launch takes it: 7 rows of 20 in chunks of 4, 16 per program (bits differ from one).
    from tests.helpers.backward_tiles import sorted_rows_batch

    batch = sorted_rows_batch([20] * 7)
    grad_out = batch.grad_out(48, seed=3)
    _, got = backward.embedding_bag_backward(grad_out, batch.ids, batch.batch_size)
    _, tuned = backward.embedding_bag_backward(
        grad_out, batch.ids, batch.batch_size, block_occ=4, subtiles=16
    )
    _, one = backward.embedding_bag_backward(grad_out, batch.ids, batch.batch_size, block_occ=4, subtiles=1)
    assert torch.equal(got, tuned) and not torch.equal(got, one)
