"""The instrumented steps of ``recaccel-bench train``: each phase of a step under a timer.

recaccel's ``off/1/off`` step runs its dense head on a detached copy of the pooled rows,
so the backward stops at them and the fused sparse update (the lookup's own backward) is
timed as a phase of its own: ``embedding_forward + sparse_update`` is the lookup and the
update as a step sees them (issue 25's criteo target), ``mlps + interaction + backward``
the dense head, forward and backward (:func:`head_flops_per_sample` makes that a FLOP
rate). The math is the plain step's: the same gradient reaches the same update.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from recaccel.bench.step.eager import EagerDLRM
from recaccel.config import Precision
from recaccel.sparse import Batch
from recaccel.train.model.objectives import autocast


def _bce(logits: Tensor, batch: Batch) -> Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, weight=batch.weights)


class PhaseTimer:
    """Wall time per phase of one step, the device synchronised around every phase.

    The synchronisations serialise host and device (no overlap between phases), so the
    instrumented step is slower than a plain one: its phases show where time goes, the
    throughput pass says how fast a step is.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[str, float]] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        self.steps.append(defaultdict(float))

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Adds the time of the ``with`` body to ``phase`` of the current step (ms)."""
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.steps[-1][phase] += (time.perf_counter() - start) * 1e3


def head_flops_per_sample(model: nn.Module) -> float:
    """FLOP per sample of a DLRM's dense head, forward and backward (backward = twice the
    forward): every linear layer of its dense and over arches (2 K N forward), and the
    interaction: a dot interaction's pairs of its R = F + 1 rows (2 D each), or a DCN-v2
    cross network's two low-rank matmuls per layer (2 (numel U + numel V))."""
    macs = sum(
        m.in_features * m.out_features
        for arch in (model.dense_arch, model.over_arch)
        for m in arch.modules()
        if isinstance(m, nn.Linear)
    )
    interaction = model.interaction_arch
    if hasattr(interaction, "u"):
        macs += interaction.u.numel() + interaction.v.numel()
    else:
        rows = interaction.num_sparse + 1
        macs += rows * (rows - 1) // 2 * interaction.dim
    return 3.0 * 2.0 * macs


def dense_head_tflops(phases: dict, head_flops: float | None, batch: int) -> float | None:
    """The dense head's rate (TFLOP/s) from a phased step's ``mlps + interaction + backward``
    (ms), or None where they are not all timed."""
    parts = [phases.get(k) for k in ("mlps", "interaction", "backward")]
    if head_flops is None or not all(isinstance(p, float) for p in parts) or sum(parts) <= 0:
        return None
    return head_flops * batch / (sum(parts) * 1e-3) / 1e12


def recaccel_phased_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, device: torch.device
) -> Callable[[Batch, PhaseTimer], None]:
    """The ``off/1/off`` step on ``model`` with each phase under the timer, the dense
    forward under ``precision``'s autocast as the trainer's objective runs it, and the
    fused sparse update timed apart from the dense backward (see the module docstring)."""

    def phased_step(batch: Batch, timer: PhaseTimer) -> None:
        with timer("dense_optimizer"):
            optimizer.zero_grad(set_to_none=True)
        with timer("embedding_forward"):
            pooled = model.embed(batch.sparse)
        # The head's backward stops at this copy; the lookup's own backward comes after.
        head_input = pooled.detach().requires_grad_(pooled.requires_grad)
        with timer("mlps"), autocast(precision, device):
            dense = model.dense_arch(batch.dense)
        with timer("interaction"), autocast(precision, device):
            features = model.interaction_arch(dense, head_input)
        with timer("mlps"):
            with autocast(precision, device):
                logits = model.over_arch(features)
            loss = _bce(logits.float(), batch)
        with timer("backward"):
            loss.backward()
        with timer("sparse_update"):
            if pooled.requires_grad:
                pooled.backward(head_input.grad)
        with timer("dense_optimizer"):
            optimizer.step()

    return phased_step


def eager_phased_step(
    model: EagerDLRM,
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    head_loss: Callable[..., Tensor],
    autocast_on: tuple[Precision, torch.device],
    compile_backend: str | None,
) -> Callable[[Batch, PhaseTimer], None]:
    """The eager step with each phase under the timer; a compiled head is one ``mlps`` phase."""
    tables, dense_opt = optimizers
    precision, device = autocast_on

    def zero_grad() -> None:
        tables.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)

    def phased_step(batch: Batch, timer: PhaseTimer) -> None:
        with timer("dense_optimizer"):
            zero_grad()
        with timer("embedding_forward"):
            pooled = model.embed(batch.sparse)
        if compile_backend is not None:
            with timer("mlps"):
                loss = head_loss(batch.dense, pooled, batch.labels, batch.weights)
        else:
            with timer("mlps"), autocast(precision, device):
                dense = model.head.bottom(batch.dense)
            with timer("interaction"), autocast(precision, device):
                features = model.head.interact(dense, pooled)
            with timer("mlps"):
                with autocast(precision, device):
                    logits = model.head.top(features).squeeze(-1)
                loss = _bce(logits.float(), batch)
        with timer("backward"):
            loss.backward()
        with timer("sparse_update"):
            tables.step()
        with timer("dense_optimizer"):
            dense_opt.step()

    return phased_step
