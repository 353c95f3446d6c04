"""``train.precision``: the float32 matmul mode a run sets for its duration.

``fp32`` and ``tf32`` keep every tensor in float32 and differ only in how CUDA multiplies
them; ``bf16`` adds autocast around the forward (:func:`recaccel.train.model.objectives.autocast`).
:func:`matmul_precision` sets torch's TF32 switches for the whole run (training steps,
their backward, evaluation) and puts them back when the run ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from recaccel.config import Precision
from recaccel.ops.tf32 import tf32

logger = logging.getLogger(__name__)


def runs_as(precision: Precision, device: torch.device) -> Precision:
    """The mode ``precision`` amounts to on ``device``: TF32 is a CUDA tensor-core format,
    so ``tf32`` runs as ``fp32`` elsewhere."""
    return "fp32" if precision == "tf32" and device.type != "cuda" else precision


def log_fallback(precision: Precision, device: torch.device) -> None:
    """Logs one line when ``precision`` runs as another mode on ``device`` (call once per run)."""
    actual = runs_as(precision, device)
    if actual != precision:
        logger.info(
            "train.precision=%s runs as %s on %s (TF32 is a CUDA tensor-core mode)", precision, actual, device
        )


@contextlib.contextmanager
def matmul_precision(precision: Precision) -> Iterator[None]:
    """Sets torch's TF32 switches for ``precision`` in the ``with`` body; restores them after.

    ``tf32``: torch's TF32 switches on (:func:`recaccel.ops.tf32.tf32`: the legacy
    ``allow_tf32`` flags, or the ``fp32_precision`` strings where the process uses that
    API; restored exactly after), so cuBLAS/cuDNN multiply float32 tensors on
    TF32 tensor cores (10-bit mantissa operands, float32 accumulation). ``fp32`` and
    ``bf16``: both off, so what runs in float32 is float32-accurate whatever the process
    had set before (under ``bf16`` the MLPs and the interaction run in bfloat16 by
    autocast; the logit layer, loss and optimizer stay float32).

    The switch is the contract with recaccel's kernels: a Triton kernel picks its
    ``tl.dot`` ``input_precision`` at launch from its input dtype (bfloat16/float16
    natively) and, for float32 inputs, from :func:`recaccel.ops.tf32.tf32_enabled`
    (on: ``"tf32"``; off: a float32-accurate mode), so it follows the run's mode without
    being told. The switches are process-wide, not per thread: the autograd engine's
    backward threads see them too. CPU matmuls ignore them, so on CPU ``tf32`` runs as
    ``fp32`` (:func:`log_fallback` says so).

    Args:
        precision: ``train.precision``.
    """
    with tf32(precision == "tf32"):
        yield
