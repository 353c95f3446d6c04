"""The embedding benchmark's candidates a CPU test can build."""

from __future__ import annotations

from recaccel.bench.kernels.embedding_cases import CandidateFactory, default_factories
from recaccel.ops.backend import fbgemm_installed


def cpu_factories() -> dict[str, CandidateFactory]:
    """The default candidates, without FBGEMM where it is not installed (Triton stays: it
    reports itself skipped on a CPU)."""
    factories = default_factories(seed=0)
    if not fbgemm_installed():
        factories.pop("fbgemm")
    return factories
