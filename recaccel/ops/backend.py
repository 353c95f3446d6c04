"""Choosing an operator backend: ``auto``, ``reference``, ``triton`` or ``fbgemm``.

Every op in :mod:`recaccel.ops` takes ``backend=``; this module turns that string into
the concrete backend for a device, and says clearly why a requested backend cannot run.

``auto`` picks, among the backends the op has: ``triton`` on CUDA, then ``fbgemm``
(when ``fbgemm_gpu`` is installed), else ``reference``. On CPU ``auto`` picks
``reference``: after its gathers and updates were tuned it is within 10% of
fbgemm-gpu-cpu 1.8.0 single-threaded (bench/results/embedding.md), and degrades less
with two busy OpenMP threads (fbgemm's backward opens a parallel region per table, each
a spin-wait when a core is busy: 0.3x the per-table loop at T=1000, B=2048 there). Ask
for ``fbgemm`` explicitly to use it. Triton kernels run
on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1``), which is a
debugging aid, so ``auto`` never picks it on CPU.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch

from recaccel.config import EmbeddingBackend, choices
from recaccel.errors import ConfigError

# Config choices that name no operator backend: ``auto`` picks one, and ``per_table`` is
# the models' per-table ``nn.EmbeddingBag`` baseline (recaccel.models.embedding).
_NOT_OP_BACKENDS = ("auto", "per_table")


def op_backends(alias: object) -> tuple[str, ...]:
    """The operator backends among a config choice alias's values (``auto`` and
    ``per_table`` left out), in declaration order."""
    return tuple(name for name in choices(alias) if name not in _NOT_OP_BACKENDS)


# Every operator backend: the embedding has them all (reference, triton, fbgemm).
BACKENDS = op_backends(EmbeddingBackend)

# Preference order of ``auto`` per device type; reference is always the last resort.
_AUTO_ORDER = {"cuda": ("triton", "fbgemm", "reference"), "cpu": ("reference",)}


class BackendUnavailableError(ConfigError, RuntimeError):
    """A known backend cannot run here (package missing, or triton on CPU tensors without
    the interpreter). A :class:`ConfigError`, so the CLI reports it in one line; a
    ``RuntimeError`` too, for callers that catch that."""


def triton_interpret_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` is set in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def fbgemm_installed() -> bool:
    """True when the ``fbgemm_gpu`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("fbgemm_gpu") is not None


def _installed(name: str) -> bool:
    if name == "triton":
        return triton_installed()
    if name == "fbgemm":
        return fbgemm_installed()
    return True


def resolve_backend(
    backend: str,
    device: torch.device | str,
    *,
    available: Sequence[str] = ("reference", "triton"),
    op: str = "op",
) -> str:
    """Resolves a backend name to the one that will run on ``device``.

    Args:
        backend: ``"auto"`` or one of :data:`BACKENDS`.
        device: The device the op's inputs live on.
        available: The backends this op implements.
        op: The op's name, for error messages.

    Returns:
        One of ``available``.

    Raises:
        ValueError: ``backend`` is unknown or not implemented by this op.
        BackendUnavailableError: ``backend`` is known but cannot run here (package
            missing, or ``triton`` on a CPU tensor without ``TRITON_INTERPRET=1``).
    """
    device = torch.device(device)
    if backend == "auto":
        for name in _AUTO_ORDER.get(device.type, ("reference",)):
            if name in available and _installed(name):
                return name
        if "reference" in available:
            return "reference"
        raise ValueError(f"{op}: no backend in {tuple(available)} runs on device {device}")
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    if backend not in available:
        raise ValueError(
            f"{op}: backend {backend!r} is not implemented; choose 'auto' or one of {tuple(available)}"
        )
    if not _installed(backend):
        package = "fbgemm_gpu" if backend == "fbgemm" else backend
        raise BackendUnavailableError(
            f"{op}: backend {backend!r} needs the {package!r} package, which is not installed"
        )
    if backend == "triton" and device.type != "cuda" and not triton_interpret_enabled():
        raise BackendUnavailableError(
            f"{op}: the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set in the environment "
            f"before recaccel's triton kernels are first imported; got tensors on {device}"
        )
    return backend


def check_triton_launchable(kernel: object, device: torch.device, op: str) -> None:
    """Raises if a Triton kernel cannot run on tensors of ``device``.

    Whether a kernel is interpreted is fixed when its module is imported (``triton.jit``
    reads ``TRITON_INTERPRET`` then), so setting the variable later does not help.

    Args:
        kernel: A ``triton.jit`` kernel object.
        device: The device of the kernel's tensors.
        op: The op's name, for the message.

    Raises:
        BackendUnavailableError: CPU tensors and a compiled (not interpreted) kernel.
    """
    if device.type == "cuda":
        return
    if type(kernel).__name__ != "InterpretedFunction":
        module = getattr(getattr(kernel, "fn", None), "__module__", "the kernel module")
        raise BackendUnavailableError(
            f"{op}: the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before {module} "
            f"is first imported; got tensors on {device} and compiled (not interpreted) kernels"
        )
