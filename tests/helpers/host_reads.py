"""Recording every host read of a tensor's value: what would synchronize with a device.

On CUDA ``torch.cuda.set_sync_debug_mode("error")`` catches a synchronization; on the CPU
there is none to see, so :func:`host_reads` records each operation that would read a
device value on the host (``item``, ``tolist``, ``bool``/``int``/``float``/``index`` of
a tensor, ``nonzero``, ``unique``, ``unique_consecutive``, ``masked_select``, ``bincount``,
and ``repeat_interleave`` with tensor repeats but no ``output_size``: the last two size
their output from device values). Host memory read on purpose goes through ``numpy()``,
which refuses a CUDA tensor.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections.abc import Iterator

import torch

_READS = {
    torch.Tensor: (
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "nonzero",
        "unique",
        "unique_consecutive",
        "masked_select",
    ),
    torch: ("nonzero", "unique", "unique_consecutive", "masked_select"),
}


def _sizes_from_tensor_repeats(*args, **kwargs) -> bool:
    """Whether a ``repeat_interleave`` call reads the device: tensor repeats (or the
    one-argument form, whose input is the repeats) and no ``output_size`` to size the result."""
    if kwargs.get("output_size") is not None:
        return False
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None)
    return isinstance(repeats, torch.Tensor)


# Reads only in some calls: (owner, name, whether a call's arguments make it read).
_SOMETIMES = [(owner, "bincount", lambda *a, **k: True) for owner in (torch.Tensor, torch)] + [
    (owner, "repeat_interleave", _sizes_from_tensor_repeats) for owner in (torch.Tensor, torch)
]


@contextlib.contextmanager
def host_reads(
    *, main_thread_only: bool = False, depth: int = 1, ignore: tuple[str, ...] = ()
) -> Iterator[list[str]]:
    """Records, as ``"name at file:line"``, each host read of a tensor's value made inside.

    Args:
        main_thread_only: Record only the main thread's reads (not a loader's thread).
        depth: How many callers to name, innermost first (``"... <- file:line"``).
        ignore: Path fragments: a read made directly by a file whose path holds one is
            not recorded (reads of values that live on the host by design).
    """
    seen: list[str] = []
    always = [(owner, name, lambda *a, **k: True) for owner, names in _READS.items() for name in names]
    saved = [(owner, name, getattr(owner, name), reads) for owner, name, reads in always + _SOMETIMES]
    main = threading.main_thread()

    def recorder(name, original, reads):
        def read(*args, **kwargs):
            if not reads(*args, **kwargs):
                return original(*args, **kwargs)
            callers = traceback.extract_stack(limit=depth + 1)[:-1][::-1]
            ignored = any(part in callers[0].filename for part in ignore)
            if not ignored and (not main_thread_only or threading.current_thread() is main):
                where = " <- ".join(f"{os.path.basename(c.filename)}:{c.lineno}" for c in callers)
                seen.append(f"{name} at {where}")
            return original(*args, **kwargs)

        return read

    for owner, name, original, reads in saved:
        setattr(owner, name, recorder(name, original, reads))
    try:
        yield seen
    finally:
        for owner, name, original, _ in saved:
            setattr(owner, name, original)
