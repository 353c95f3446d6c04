"""The host side of a cached pack: the full rows and optimizer state, staging, transfers.

A host-placed pack keeps its rows [R, D] and optimizer state ([R] or [R, D] float32 per
state) in host memory, pinned when the cache is on CUDA. Rows move between the host and
the device cache [C, ...] in one transfer each way:

- fetch: the missing rows and their state are gathered on the host into a staging buffer
  (one segment per tensor: [K, D] rows, then each state), copied to the device at once
  (``non_blocking`` from pinned memory, on the caller's current stream: the cache's copy
  stream) and scattered into their slots;
- write-back: dirty victims' rows and state are gathered on the device, copied at once
  into a second staging buffer and, once the copy is done, scattered into the host
  tensors. On CUDA the copy is left in flight (``pending``) and finished by
  :meth:`HostStore.complete_pending` (at the next preparation or flush), so that the
  preparation never waits for the step in flight.

A staging buffer is reused only after its previous copy has finished (an event on CUDA);
it grows on demand to at most the cache's C rows.

Shapes: R rows of the pack, C slots, K rows moved, D dim, W = D + state columns per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.memory_limits import CGROUP_ROOT, available_memory
from recaccel.ops.embedding.packing import PackLayout
from recaccel.ops.embedding.specs import OPTIMIZER_STATES

_BYTES = 4  # float32 rows and state


def row_widths(layout: PackLayout) -> dict[str, int]:
    """Columns per row of each tensor of a pack (``weight`` first, then its optimizer state)."""
    widths = {"weight": layout.dim}
    for name, rowwise in OPTIMIZER_STATES[layout.optimizer]:
        widths[name] = 1 if rowwise else layout.dim
    return widths


def host_bytes(layout: PackLayout) -> int:
    """Host memory of a host-placed pack: R * W float32."""
    return layout.num_rows * sum(row_widths(layout).values()) * _BYTES


def available_host_memory(cgroup_root: str | Path = CGROUP_ROOT) -> int | None:
    """Bytes of host memory this process can still allocate: the least of
    ``MemAvailable``, its cgroup's limit less its usage (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``, under ``cgroup_root``) and ``RLIMIT_AS`` less its virtual
    size (see :mod:`recaccel.memory_limits`); None when none can be read."""
    return available_memory(cgroup_root)


def check_host_memory(layouts: list[PackLayout], available: int | None = None) -> None:
    """Raises ConfigError when the host-placed packs' rows and state do not fit in the
    available host memory (checked before anything is allocated).

    Args:
        layouts: The host-placed packs.
        available: Bytes available (default :func:`available_host_memory`; unknown: no check).
    """
    need = sum(host_bytes(layout) for layout in layouts)
    available = available_host_memory() if available is None else available
    if available is not None and need > available:
        names = [t.name for layout in layouts for t in layout.tables]
        raise ConfigError(
            f"model.embedding_placement: the host-placed tables {names} need {need / 2**30:.2f} GiB of host "
            f"memory (rows and optimizer state) but only {available / 2**30:.2f} GiB is available"
        )


class HostStore:
    """The host tensors of one pack and its staging buffers (see the module docstring).

    Args:
        layout: The pack.
        weights: Initial float32 [R_t, D] rows of each table (CPU).
        device: The cache's device (CUDA: pinned host memory and asynchronous copies).
        capacity: C, the most rows one transfer moves (the staging buffers' bound).
    """

    def __init__(
        self, layout: PackLayout, weights: list[Tensor], device: torch.device, capacity: int
    ) -> None:
        self.device = device
        self.capacity = capacity
        self.cuda = device.type == "cuda"
        self.widths = row_widths(layout)
        self.row_width = sum(self.widths.values())
        shapes = {
            name: (layout.num_rows,) if w == 1 else (layout.num_rows, w) for name, w in self.widths.items()
        }
        self.tensors: dict[str, Tensor] = {
            name: torch.zeros(shape, dtype=torch.float32, pin_memory=self.cuda)
            for name, shape in shapes.items()
        }
        torch.cat(weights, out=self.tensors["weight"])
        self._staging: dict[str, Tensor | None] = {"h2d": None, "d2h": None}
        self._h2d_done: torch.cuda.Event | None = None
        self._pending: tuple[torch.cuda.Event, Tensor] | None = None  # (copy done, host rows)

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers now allocated."""
        return sum(0 if b is None else b.numel() * _BYTES for b in self._staging.values())

    def reset_staging(self) -> None:
        """Frees the staging buffers once no copy uses them (they grow again on demand)."""
        self.complete_pending()
        if self._h2d_done is not None:
            self._h2d_done.synchronize()
            self._h2d_done = None
        self._staging = {"h2d": None, "d2h": None}

    def _buffer(self, kind: str, rows: int) -> Tensor:
        """The staging buffer ``kind`` with room for ``rows`` rows, free to be written."""
        if kind == "h2d" and self._h2d_done is not None:
            self._h2d_done.synchronize()  # the previous fetch still reads it
            self._h2d_done = None
        if kind == "d2h":
            self.complete_pending()
        buf = self._staging[kind]
        need = rows * self.row_width
        if buf is None or buf.numel() < need:
            size = min(max(need, 0 if buf is None else 2 * buf.numel()), self.capacity * self.row_width)
            buf = self._staging[kind] = torch.empty(size, dtype=torch.float32, pin_memory=self.cuda)
        return buf

    def _segments(self, flat: Tensor, rows: int) -> dict[str, Tensor]:
        """Views of a staging area of ``rows`` rows, one contiguous segment per tensor."""
        out, start = {}, 0
        for name, w in self.widths.items():
            seg = flat[start : start + rows * w]
            out[name] = seg if w == 1 else seg.view(rows, w)
            start += rows * w
        return out

    @torch.no_grad()
    def fetch(self, cache: Mapping[str, Tensor], rows: Tensor, slots: Tensor) -> int:
        """Copies host ``rows`` into the cache's ``slots`` (one transfer).

        Args:
            cache: The device cache's tensors by name ([C, D] rows, [C] or [C, D] state).
            rows: int64 [K] packed rows, on the CPU.
            slots: int64 [K] their slots, on the cache's device.

        Returns:
            Bytes copied host to device.
        """
        k = rows.numel()
        if k == 0:
            return 0
        flat = self._buffer("h2d", k)[: k * self.row_width]
        for name, seg in self._segments(flat, k).items():
            torch.index_select(self.tensors[name], 0, rows, out=seg)
        moved = flat.to(self.device, non_blocking=True)  # the one transfer (the buffer itself on CPU)
        for name, seg in self._segments(moved, k).items():
            cache[name].index_copy_(0, slots, seg)
        if self.cuda:
            self._h2d_done = torch.cuda.Event()
            self._h2d_done.record()
        return k * self.row_width * _BYTES

    @torch.no_grad()
    def write_back(self, cache: Mapping[str, Tensor], slots: Tensor, rows: Tensor) -> int:
        """Copies the cache's ``slots`` back to host ``rows`` (one transfer; on CUDA left
        pending until :meth:`complete_pending`).

        Args:
            cache: The device cache's tensors by name.
            slots: int64 [K] slots, on the cache's device.
            rows: int64 [K] their packed rows, on the CPU.

        Returns:
            Bytes copied device to host.
        """
        k = rows.numel()
        if k == 0:
            return 0
        flat = torch.cat([cache[name].index_select(0, slots).reshape(-1) for name in self.widths])
        if not self.cuda:
            self._scatter(flat, rows)
            return k * self.row_width * _BYTES
        buf = self._buffer("d2h", k)[: k * self.row_width]
        buf.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (done, rows)
        return k * self.row_width * _BYTES

    def complete_pending(self) -> None:
        """Waits for the write-back in flight, if any, and stores its rows on the host."""
        if self._pending is None:
            return
        done, rows = self._pending
        self._pending = None
        done.synchronize()
        self._scatter(self._staging["d2h"][: rows.numel() * self.row_width], rows)

    def _scatter(self, flat: Tensor, rows: Tensor) -> None:
        for name, seg in self._segments(flat, rows.numel()).items():
            self.tensors[name].index_copy_(0, rows, seg)
