"""The benchmarks ``recaccel-bench`` runs: name -> (help, add_args, main).

Each benchmark module exposes ``add_args(parser)`` and ``main(args, command_line) -> Path``
(the markdown summary it wrote);
modules are imported only when their benchmark runs (tests/test_layout.py checks each
module named here exists, so a moved benchmark cannot silently drop out of the CLI).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

_MODULES = {
    "embedding": (
        "packed embedding bag vs per-table loop, reference, Triton, FBGEMM",
        "recaccel.bench.kernels.embedding",
    ),
    "kernels": (
        "Triton embedding kernels: config sweep within a time budget, share of copy bandwidth, tuning table",
        "recaccel.bench.kernels.sweep",
    ),
    "interaction": ("fused DLRM dot interaction vs PyTorch eager", "recaccel.bench.kernels.interaction"),
    "interaction_tune": (
        "Triton dot interaction: launch-config sweep within a time budget, share of copy bandwidth, tuning table",
        "recaccel.bench.kernels.interaction_tune",
    ),
    "meta": ("vmapped MAML step vs per-task loop", "recaccel.bench.data.meta"),
    "io": ("Parquet plain and task batches vs raw pyarrow", "recaccel.bench.data.io"),
    "comm": ("hybrid step bytes: measured vs analytic", "recaccel.bench.distributed.comm"),
    "cache": ("embedding cache hit rate: lookahead vs LRU, LFU, Belady", "recaccel.bench.cache.hit_rates"),
    "cache_train": (
        "training samples/s with host-placed tables: cached vs all on the device vs a minimal cache",
        "recaccel.bench.cache.train",
    ),
    "train": (
        "whole training steps: recaccel vs hand-written eager, reference and torch.compile",
        "recaccel.bench.step.train",
    ),
    "straggler": (
        "hybrid samples/s with one slowed rank: clean, unmitigated, rebalance, backup",
        "recaccel.bench.distributed.straggler",
    ),
}


def _lazy(module: str, attr: str) -> Callable:
    def call(*args):
        return getattr(importlib.import_module(module), attr)(*args)

    return call


BENCHMARKS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {
    name: (help_text, _lazy(module, "add_args"), _lazy(module, "main"))
    for name, (help_text, module) in _MODULES.items()
}
