"""Seeded sparse batches for the operator tests, and compiling a kernel in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from recaccel.sparse import SparseFeatures


def random_sparse_batch(
    rows_by_feature: dict[str, int],
    keys: list[str],
    batch_size: int,
    *,
    max_len: int = 4,
    weighted: bool = False,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> SparseFeatures:
    """A random batch: bag lengths uniform in [0, max_len] (so empty bags occur), ids uniform
    in each feature's table (small tables give duplicates within and across bags)."""
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch_size,), generator=generator)
    values = []
    for f, key in enumerate(keys):
        n = int(lengths[f * batch_size : (f + 1) * batch_size].sum())
        values.append(torch.randint(0, rows_by_feature[key], (n,), generator=generator))
    ids = torch.cat(values) if values else torch.zeros(0, dtype=torch.int64)
    weights = torch.rand(ids.numel(), generator=generator) + 0.5 if weighted else None
    return SparseFeatures.from_lengths(keys, ids, lengths, weights).to(device)


def compile_in_subprocess(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Runs ``script`` (which calls Triton's compiler, never run by the interpreter) in a
    process with the interpreter off and a fresh kernel cache under ``tmp_path``."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
    )
