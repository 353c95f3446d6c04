"""Moving decoded data between processes through reusable shared-memory slots.

A value (a dataclass, list, tuple, dict of numpy arrays, torch tensors, scalars and
None, nested) is split into a *skeleton* (small, pickled over a pipe) and its arrays'
bytes, which a :class:`SlotWriter` copies into one of its shared-memory slots; a
:class:`SlotReader` in the other process copies them back out into fresh arrays, so the
slot can be reused at once and nothing the reader returns aliases shared memory.
Arrays keep dtype, shape and memory order (C or Fortran); anything else is pickled in
the skeleton as it is.

Segments are named ``<prefix>s<slot>g<generation>`` (a slot too small for a value is
replaced by a larger one with the next generation). Python's resource tracker is kept
out of it: the creator and the reader both unlink by name (:func:`unlink_prefix`), so a
killed process leaves nothing behind its peer cannot remove.
"""

from __future__ import annotations

import _posixshmem
import dataclasses
import glob
import os
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

_ALIGN = 64
_SHM_DIR = "/dev/shm"


def flatten(value: Any) -> tuple[Any, list[np.ndarray | torch.Tensor]]:
    """(skeleton, arrays): ``value`` with each array replaced by its index in ``arrays``."""
    arrays: list[np.ndarray | torch.Tensor] = []
    return _flat(value, arrays), arrays


def _flat(v: Any, arrays: list) -> Any:
    if isinstance(v, torch.Tensor) or (isinstance(v, np.ndarray) and v.dtype != object):
        arrays.append(v)
        return ("a", len(arrays) - 1)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return ("d", type(v), [(f.name, _flat(getattr(v, f.name), arrays)) for f in dataclasses.fields(v)])
    if isinstance(v, list):
        return ("l", [_flat(x, arrays) for x in v])
    if type(v) is tuple:
        return ("t", [_flat(x, arrays) for x in v])
    if isinstance(v, dict):
        return ("m", [(k, _flat(x, arrays)) for k, x in v.items()])
    return ("v", v)


def unflatten(skeleton: Any, arrays: list[np.ndarray | torch.Tensor]) -> Any:
    """The value :func:`flatten` split into ``skeleton`` and ``arrays``."""
    kind = skeleton[0]
    if kind == "a":
        return arrays[skeleton[1]]
    if kind == "d":
        obj = object.__new__(skeleton[1])
        for name, node in skeleton[2]:  # no __init__: the value was checked where it was made
            object.__setattr__(obj, name, unflatten(node, arrays))
        return obj
    if kind == "l":
        return [unflatten(x, arrays) for x in skeleton[1]]
    if kind == "t":
        return tuple(unflatten(x, arrays) for x in skeleton[1])
    if kind == "m":
        return {k: unflatten(x, arrays) for k, x in skeleton[1]}
    return skeleton[1]


def _raw(a: np.ndarray | torch.Tensor) -> tuple[np.ndarray, tuple]:
    """The array's bytes as a flat uint8 array, and how to rebuild it."""
    if isinstance(a, torch.Tensor):
        t = a.detach().cpu().contiguous().reshape(-1)
        return t.view(torch.uint8).numpy(), ("torch", t.dtype, tuple(a.shape))
    order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    flat = np.ascontiguousarray(a.ravel(order=order))
    return flat.view(np.uint8), ("numpy", a.dtype.str, a.shape, order)


def _rebuild(spec: tuple, raw: np.ndarray) -> np.ndarray | torch.Tensor:
    """A fresh array of ``spec`` holding a copy of the bytes ``raw``."""
    if spec[0] == "torch":
        out = torch.empty(spec[2], dtype=spec[1])
        if raw.size:
            out.reshape(-1).view(torch.uint8).numpy()[:] = raw
        return out
    _, dtype, shape, order = spec
    out = np.empty(shape, dtype=np.dtype(dtype), order=order)
    if raw.size:
        out.ravel(order="K").view(np.uint8)[:] = raw
    return out


class SlotWriter:
    """The writing side: ``slots`` reusable segments named ``<prefix>s<i>g<gen>``."""

    def __init__(self, prefix: str, slots: int) -> None:
        self.prefix = prefix
        self._shm: list[shared_memory.SharedMemory | None] = [None] * slots
        self._gen = [0] * slots

    def write(self, slot: int, value: Any) -> tuple[str, Any, list[tuple[tuple, int, int]]]:
        """Copies ``value``'s arrays into slot ``slot``; returns what :meth:`SlotReader.read`
        needs: (segment name, skeleton, [(array spec, offset, bytes)])."""
        skeleton, arrays = flatten(value)
        raws, layout, size = [], [], 0
        for a in arrays:
            raw, spec = _raw(a)
            raws.append(raw)
            layout.append((spec, size, raw.size))
            size += -(-raw.size // _ALIGN) * _ALIGN
        shm = self._segment(slot, size)
        for raw, (_, offset, n) in zip(raws, layout, strict=True):
            if n:
                np.frombuffer(shm.buf, np.uint8, n, offset)[:] = raw
        return shm.name, skeleton, layout

    def _segment(self, slot: int, size: int) -> shared_memory.SharedMemory:
        shm = self._shm[slot]
        if shm is not None and shm.size >= size:
            return shm
        if shm is not None:
            _drop(shm)
        self._gen[slot] += 1
        name = f"{self.prefix}s{slot}g{self._gen[slot]}"
        shm = shared_memory.SharedMemory(name, create=True, size=max(_ALIGN, size + size // 4))
        _untrack(shm)
        self._shm[slot] = shm
        return shm

    def close(self) -> None:
        """Unmaps and unlinks every slot."""
        for shm in self._shm:
            if shm is not None:
                _drop(shm)
        self._shm = [None] * len(self._shm)


class SlotReader:
    """The reading side: maps segments by name (kept open while their name is current)."""

    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}

    def read(self, message: tuple[str, Any, list[tuple[tuple, int, int]]]) -> Any:
        """A copy of the value a :meth:`SlotWriter.write` returned ``message`` for."""
        name, skeleton, layout = message
        shm = self._open.get(name)
        if shm is None:
            self._forget_older(name)
            shm = self._open[name] = shared_memory.SharedMemory(name)
            _untrack(shm)
        arrays = [_rebuild(spec, np.frombuffer(shm.buf, np.uint8, n, offset)) for spec, offset, n in layout]
        return unflatten(skeleton, arrays)

    def _forget_older(self, name: str) -> None:
        """Unmaps the earlier generations of ``name``'s slot (the writer replaced them)."""
        stem = name.rsplit("g", 1)[0] + "g"
        for old in [n for n in self._open if n.startswith(stem)]:
            self._open.pop(old).close()

    def close(self) -> None:
        """Unmaps every segment (unlinking is the owner's job, or :func:`unlink_prefix`)."""
        for shm in self._open.values():
            try:
                shm.close()
            except BufferError:  # a copy cut short (Ctrl-C) still views it: unmapped once collected
                pass
        self._open.clear()


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Takes the segment off the resource tracker: its owners unlink it by name, and the
    tracker would otherwise warn about (or unlink) segments another process still uses."""
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (the tracker's key)


def _drop(shm: shared_memory.SharedMemory) -> None:
    """Unmaps and unlinks ``shm`` without telling the tracker (see :func:`_untrack`)."""
    shm.close()
    try:
        _posixshmem.shm_unlink(shm._name)  # noqa: SLF001 (unlink() would unregister it again)
    except FileNotFoundError:  # the peer unlinked it first
        pass


def unlink_prefix(prefix: str) -> None:
    """Unlinks every segment whose name starts with ``prefix`` (those of a killed writer)."""
    for path in glob.glob(os.path.join(_SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
