"""The trainer end to end on CUDA: train, checkpoint, resume; against the CPU run.

Tiny synthetic data (the resume matrix's). On CUDA the embedding backend is Triton
(auto), whose fused backward sums gradients in a different order than the CPU
reference: runs are compared within float32 tolerance, not bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from recaccel.cli import train_main
from tests.helpers.resume import STEPS_PER_EPOCH, final_entries, small_sets

pytestmark = pytest.mark.gpu

TIMING = {"samples_per_s", "data_wait_s", "data_startup_s", "data_wait_fraction", "train_seconds"}


def _close(
    a: Any, b: Any, where: str = "", rtol: float = 1e-4, atol: float = 1e-5, tensors_only=False
) -> None:
    """Equal structure; floats and float tensors within tolerance, the rest equal
    (``tensors_only``: other leaves, e.g. the saved config naming the device, not compared)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            if key not in TIMING:
                _close(a[key], b[key], f"{where}.{key}", rtol, atol, tensors_only)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]", rtol, atol, tensors_only)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        if a.is_floating_point():
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a.cpu(), b.cpu()), where
    elif tensors_only:
        return
    elif isinstance(a, float):
        assert math.isfinite(a) == math.isfinite(b) and (
            not math.isfinite(a) or math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
        ), where
    else:
        assert a == b, where


def _run(data: Path, out: Path, device: str, *extra: str) -> dict:
    argv = small_sets(
        data, out, f'train.device="{device}"', f"train.checkpoint_every={STEPS_PER_EPOCH}", *extra
    )
    assert train_main(argv) == 0
    return json.loads((out / "metrics.json").read_text())


def test_gpu_trainer_resumed_run_equals_the_uninterrupted_one(small_data, tmp_path):  # noqa: F811
    full = _run(small_data, tmp_path / "full", "cuda")
    assert full["steps"] == 2 * STEPS_PER_EPOCH and math.isfinite(full["train_loss"])
    part = tmp_path / "part"
    _run(small_data, part, "cuda", f"train.steps={STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2}")  # stops mid-epoch
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    resumed = json.loads((part / "metrics.json").read_text())
    _close(full, resumed, "metrics")
    _close(final_entries(tmp_path / "full"), final_entries(part), "checkpoint")


def test_gpu_trainer_matches_the_cpu_run(small_data, tmp_path):  # noqa: F811
    gpu = _run(small_data, tmp_path / "gpu", "cuda")
    cpu = _run(small_data, tmp_path / "cpu", "cpu")
    assert gpu["steps"] == cpu["steps"]
    assert gpu["data"]["batches_yielded"] == cpu["data"]["batches_yielded"]
    # Same data, same initial weights, float32 on both: the runs stay close (sums in another order).
    assert math.isclose(gpu["train_loss"], cpu["train_loss"], rel_tol=1e-2)
    _close(
        final_entries(tmp_path / "gpu"),
        final_entries(tmp_path / "cpu"),
        "checkpoint",
        rtol=1e-2,
        atol=1e-3,
        tensors_only=True,
    )
