"""The interaction and DCN-v2 benchmarks refuse to time a candidate whose forward or
gradients differ from the float64 reference (on CPU: deliberately wrong candidates)."""

from __future__ import annotations

import pytest
import torch

from recaccel.bench.kernels.dcnv2 import bench_shape
from recaccel.bench.kernels.interaction import _bench_one
from recaccel.errors import RecaccelError
from recaccel.ops.interaction import dcnv2_cross_reference, dot_interaction_reference


def _dot(dense, pooled, pad):
    return dot_interaction_reference(torch.cat([dense.unsqueeze(1), pooled], 1), pad)


def _grad_scaled(out, scale=1.05):
    """``out``'s value with gradients ``scale`` times too large."""
    return out + (scale - 1) * (out - out.detach())


WRONG_DOT = {
    "forward": lambda dense, pooled, pad: _dot(dense, pooled, pad) * 1.01,
    "backward": lambda dense, pooled, pad: _grad_scaled(_dot(dense, pooled, pad)),
}
WRONG_CROSS = {
    "forward": lambda *t: dcnv2_cross_reference(*t) * 1.01,
    "backward": lambda *t: _grad_scaled(dcnv2_cross_reference(*t)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wrong", ["forward", "backward"])
def test_a_dot_candidate_with_a_wrong_forward_or_gradient_is_refused_before_timing(wrong, dtype):
    with pytest.raises(RecaccelError, match="candidate 'triton'"):
        _bench_one(8, 3, 4, dtype, torch.device("cpu"), 1, 0, WRONG_DOT[wrong], None, pad=True)


@pytest.mark.parametrize("wrong", ["forward", "backward"])
def test_a_cross_candidate_with_a_wrong_forward_or_gradient_is_refused_before_timing(wrong):
    with pytest.raises(RecaccelError, match="candidate 'triton'"):
        _bench_one(4, 2, 3, torch.float32, torch.device("cpu"), 1, 0, WRONG_CROSS[wrong], None, "dcnv2", 2, 3)


@pytest.mark.parametrize("wrong", ["forward", "backward"])
def test_a_dcnv2_bench_implementation_with_a_wrong_forward_or_gradient_is_refused_before_timing(wrong):
    impls = {"eager": dcnv2_cross_reference, "gemm": WRONG_CROSS[wrong]}
    with pytest.raises(RecaccelError, match="candidate 'gemm'"):
        bench_shape(4, 2, 3, 2, 3, torch.float32, torch.device("cpu"), 1, 0, impls=impls)


def test_a_right_candidate_is_timed_with_its_errors_reported():
    row = _bench_one(8, 3, 4, torch.bfloat16, torch.device("cpu"), 1, 0, _dot, None, pad=True)
    assert row["triton_fwd_ms"] > 0 and 0 <= row["max_rel_err"] < 1e-2 and 0 <= row["max_rel_err_grad"] < 1e-2
    row = bench_shape(
        4,
        2,
        3,
        2,
        3,
        torch.float32,
        torch.device("cpu"),
        1,
        0,
        impls={"eager": dcnv2_cross_reference, "gemm": dcnv2_cross_reference},
    )
    assert row["gemm_fwd_ms"] > 0 and row["gemm_rel_err"] < 1e-6 and row["gemm_grad_rel_err"] < 1e-6
