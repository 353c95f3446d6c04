"""recaccel pins MKL to one code path before torch first multiplies on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

from recaccel.reproducible import DEFAULT_MKL_CBWR, MKL_CBWR, pin_cpu_matmul_path

PROBE = "import os, sys, recaccel; print(os.environ.get('MKL_CBWR'), 'torch' in sys.modules)"


def _import_recaccel(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_importing_recaccel_pins_mkl_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != MKL_CBWR}
    assert _import_recaccel(env) == f"{DEFAULT_MKL_CBWR} False"


def test_a_users_mkl_cbwr_is_left_as_it_is():
    assert _import_recaccel({**os.environ, MKL_CBWR: "COMPATIBLE"}) == "COMPATIBLE False"


def test_pin_sets_only_an_unset_value():
    assert pin_cpu_matmul_path({}) == DEFAULT_MKL_CBWR
    assert pin_cpu_matmul_path({MKL_CBWR: "AUTO"}) == "AUTO"
