"""Reading and setting torch's TF32 switch without tripping over torch's two APIs.

torch has two APIs for "may float32 matmuls run on TF32 tensor cores": the legacy flags
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``,
``torch.set_float32_matmul_precision``) and, since torch 2.9, per-backend
``fp32_precision`` strings (``"tf32"``, ``"ieee"``, or ``"none"`` = inherit the generic
``torch.backends.fp32_precision``). Once a process sets the new API, reading a legacy
flag raises ``RuntimeError`` ("mix of the legacy and new APIs"). So recaccel speaks the
API the process already speaks: the new one where a legacy read would raise, else the
legacy flags (which other code may still read), and afterwards it puts every switch back
exactly, new-API strings included (the legacy setter leaves ``"ieee"`` where there was
``"none"``, which is not the state the process had).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _new_api() -> dict[str, Any]:
    """The new API's switch owners (CUDA matmul, cuDNN convolution and RNN); empty on a
    torch without it."""
    b = torch.backends
    owners = {
        "matmul": b.cuda.matmul,
        "conv": getattr(b.cudnn, "conv", None),
        "rnn": getattr(b.cudnn, "rnn", None),
    }
    try:
        ok = all(o is not None and isinstance(o.fp32_precision, str) for o in owners.values())
    except (AttributeError, RuntimeError):
        ok = False
    return owners if ok else {}


def _legacy_readable() -> bool:
    """Whether both legacy flags read without raising: torch refuses a legacy read when
    the new-API strings set hold a state the legacy flag cannot express (e.g. matmul
    ``"tf32"`` beside cuDNN ``"ieee"``), so a process that only ever used the legacy
    API (or set the strings consistently) passes."""
    try:
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018 (the reads are the test)
        torch.backends.cudnn.allow_tf32  # noqa: B018
    except RuntimeError:
        return False
    return True


def tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls may run on TF32 tensor cores (what cuBLAS does, and
    so what a Triton ``tl.dot`` over float32 follows), in any API state."""
    if _legacy_readable():
        return bool(torch.backends.cuda.matmul.allow_tf32)
    mode = torch.backends.cuda.matmul.fp32_precision
    if mode == "none":  # inherits the generic setting
        mode = getattr(torch.backends, "fp32_precision", "none")
    return mode == "tf32"


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 on (or off) for float32 CUDA matmuls and cuDNN inside the block; every switch
    is back to exactly what it was after. The switches are process-wide."""
    new = _new_api()
    saved_new = {k: o.fp32_precision for k, o in new.items()}
    legacy = _legacy_readable()
    m, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved_legacy = (m.allow_tf32, cudnn.allow_tf32) if legacy else None
    if legacy:
        m.allow_tf32 = cudnn.allow_tf32 = enabled
    else:
        for o in new.values():
            o.fp32_precision = "tf32" if enabled else "ieee"
    try:
        yield
    finally:
        if saved_legacy is not None:
            m.allow_tf32, cudnn.allow_tf32 = saved_legacy
        for k, o in new.items():
            o.fp32_precision = saved_new[k]
