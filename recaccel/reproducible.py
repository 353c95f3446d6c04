"""One CPU matrix-product code path for every process: MKL's conditional numerical
reproducibility (CNR).

Without it MKL picks its GEMM kernels per call, from the CPU and from run-time conditions,
so the same float32 training run ends in other last digits after another process history:
the debug preset gave test AUC 0.72727 from ``recaccel-train`` and 0.72700 from
``recaccel.train`` in Python, on one AVX-512 host with the same data and seed (2026-11-26).
``MKL_CBWR=AVX2,STRICT`` pins MKL to its AVX2 kernels with a fixed order of operations
whatever the alignment or history, which also makes the result the same on any x86 CPU
with AVX2 as far as MKL is concerned (0.72672 from the CLI and the API, with 1 or 2
threads, under ATen's AVX-512 and AVX2 kernels, on that host). At the debug preset it cost
no measurable time. GPU runs do not use MKL.

MKL reads the variable at its first call in the process, so :func:`pin_cpu_matmul_path`
runs when ``recaccel`` is imported, before torch; a process that multiplied matrices on the
CPU before importing recaccel keeps its MKL mode (set ``MKL_CBWR`` in its environment).
A value the user set is left as it is.
"""

from __future__ import annotations

import os

MKL_CBWR = "MKL_CBWR"
DEFAULT_MKL_CBWR = "AVX2,STRICT"


def pin_cpu_matmul_path(environ: os._Environ | dict[str, str] = os.environ) -> str:
    """Sets ``MKL_CBWR`` to :data:`DEFAULT_MKL_CBWR` unless already set; returns the value in force."""
    return environ.setdefault(MKL_CBWR, DEFAULT_MKL_CBWR)
