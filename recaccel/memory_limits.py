"""How much memory this process may still allocate: the tightest of the machine's, its
cgroup's and its own address-space limit.

``MemAvailable`` alone overstates what a process in a container (a cgroup with a
``memory.max``) or under ``ulimit -v`` (``RLIMIT_AS``) can get: there the kernel or the
allocator stops it long before the machine runs out. Each limit's headroom is its bound
minus what is already used; :func:`available_memory` is the least of those known.

Imports nothing but the standard library (so it works in a process that has just
lowered its own limits).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large is none.
_V1_UNLIMITED = 2**62


def available_memory(
    cgroup_root: str | Path = CGROUP_ROOT,
    meminfo: str | Path = "/proc/meminfo",
    proc_cgroup: str | Path = "/proc/self/cgroup",
) -> int | None:
    """Bytes this process can still allocate: the least of ``MemAvailable``, its
    cgroup's headroom and its ``RLIMIT_AS`` headroom (None when none can be read).

    Args:
        cgroup_root: where the cgroup file systems are mounted (v2: ``memory.max`` here;
            v1: ``memory/memory.limit_in_bytes``).
        meminfo: the kernel's memory summary.
        proc_cgroup: this process's cgroup membership (its own cgroup below the root).
    """
    known = [
        v
        for v in (
            mem_available(meminfo),
            cgroup_headroom(cgroup_root, proc_cgroup),
            address_space_headroom(),
        )
        if v is not None
    ]
    return min(known) if known else None


def mem_available(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, else the free pages ``os.sysconf`` reports, else None."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_headroom(
    root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = "/proc/self/cgroup"
) -> int | None:
    """The least ``limit - usage`` of this process's cgroup and its ancestors, v2
    (``memory.max`` - ``memory.current``) and v1 (``memory.limit_in_bytes`` -
    ``memory.usage_in_bytes``); None when no level sets a limit.

    A parent's limit binds its children too, so every level from the process's own
    cgroup up to ``root`` that exists under ``root`` is read.
    """
    root = Path(root)
    own = _own_cgroups(proc_cgroup)
    levels = [(d, "memory.max", "memory.current", None) for d in _levels(root, own.get("", "/"))]
    v1 = root / "memory"
    levels += [
        (d, "memory.limit_in_bytes", "memory.usage_in_bytes", _V1_UNLIMITED)
        for d in _levels(v1, own.get("memory", "/"))
    ]
    room = [r for r in (_headroom(*level) for level in levels) if r is not None]
    return min(room) if room else None


def address_space_headroom() -> int | None:
    """``RLIMIT_AS`` (soft) minus this process's virtual size; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0  # unknown: the limit itself is still an upper bound
    return max(0, soft - used)


def _own_cgroups(proc_cgroup: str | Path) -> dict[str, str]:
    """This process's cgroup path per controller ("" = the v2 hierarchy), from lines
    ``id:controllers:path``."""
    found: dict[str, str] = {}
    try:
        text = Path(proc_cgroup).read_text()
    except OSError:
        return found
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                found[controller] = parts[2]
    return found


def _levels(base: Path, own: str) -> Iterator[Path]:
    """``base/own`` and each of its parents up to ``base``, those that exist."""
    path = base / own.lstrip("/")
    while True:
        if path.is_dir():
            yield path
        if path == base or base not in path.parents:
            return
        path = path.parent


def _headroom(folder: Path, limit_file: str, usage_file: str, unlimited: int | None) -> int | None:
    """``limit - usage`` of one cgroup level, None when it sets no limit or cannot be read."""
    try:
        limit_text = (folder / limit_file).read_text().strip()
        if limit_text == "max":
            return None
        limit = int(limit_text)
        if unlimited is not None and limit >= unlimited:
            return None
        usage = int((folder / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    return max(0, limit - usage)
