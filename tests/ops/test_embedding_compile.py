"""The Triton embedding kernels compile for a real GPU (sm_90), even on a machine without one.

The forward's kernels are compiled by tests/ops/test_embedding_forward_tiles.py.
The interpreter used by the other tests never runs Triton's compiler, so typing or
lowering errors would only show on a GPU. This compiles every kernel variant ahead of
time to a cubin in a subprocess (where TRITON_INTERPRET is off).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from recaccel.ops.embedding.triton import kernels as K

    COMMON = {"batch_size": "i32", "dim": "i32"}
    GRAD = {"grad_out_ptr": "*fp32", "bags_ptr": "*i64", "scale_ptr": "*fp32", "seg_ptr": "*i64"}
    GRAD_STRIDES = {"stride_gb": "i32", "stride_gf": "i32", "stride_gd": "i32"}
    BWD = {
        **GRAD, "out_ptr": "*fp32", **COMMON, **GRAD_STRIDES,
        "HAS_SCALE": "constexpr", "BLOCK_L": "constexpr", "BLOCK_D": "constexpr",
    }
    UPD = {
        "weight_ptr": "*fp32", "m1_ptr": "*fp32", "m2_ptr": "*fp32", "rows_ptr": "*i64", **GRAD, **COMMON,
        "stride_w": "i32", **GRAD_STRIDES, "lr": "fp32", "eps": "fp32", "beta1": "fp32", "beta2": "fp32",
        "weight_decay": "fp32", "bias_c1": "fp32", "bias_c2": "fp32",
        "OPTIMIZER": "constexpr", "HAS_SCALE": "constexpr", "BLOCK_L": "constexpr", "BLOCK_D": "constexpr",
    }
    variants = [(K._embedding_bag_bwd_kernel, BWD, {"HAS_SCALE": s, "BLOCK_L": 16, "BLOCK_D": 128})
                 for s in (False, True)]
    variants += [(K._embedding_bag_fused_update_kernel, UPD,
                  {"OPTIMIZER": o, "HAS_SCALE": s, "BLOCK_L": 16, "BLOCK_D": 64})
                 for o in (0, 1, 2) for s in (False, True)]
    for fn, signature, constexprs in variants:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
        )
        assert compiled.asm["cubin"], fn
    print("compiled", len(variants))
    """
)


def test_triton_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "compiled 8" in done.stdout
