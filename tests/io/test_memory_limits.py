"""The host-memory check sees the process's limits: its cgroup's (v2 and v1, read under a
cgroup root given as an argument) and its own ``RLIMIT_AS`` (set for real in a child
process), not only the machine's ``MemAvailable``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from recaccel.memory_limits import available_memory, cgroup_headroom, mem_available

MIB = 2**20
GIB = 2**30


def _write(folder: Path, **files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text + "\n")
    return folder


def _proc_cgroup(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "proc_self_cgroup"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _meminfo(tmp_path: Path, kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {4 * kib} kB\nMemAvailable:   {kib} kB\n")
    return path


def test_cgroup_v2_limit_less_usage_bounds_available_memory(tmp_path):
    root = _write(tmp_path / "cg", memory_max=str(GIB), memory_current=str(900 * MIB))
    proc = _proc_cgroup(tmp_path, "0::/")
    assert cgroup_headroom(root, proc) == GIB - 900 * MIB
    meminfo = _meminfo(tmp_path, 64 * GIB // 1024)  # the machine has far more
    got = available_memory(cgroup_root=root, meminfo=meminfo, proc_cgroup=proc)
    assert got is not None and got <= GIB - 900 * MIB


def test_cgroup_v2_max_sets_no_limit_and_meminfo_decides(tmp_path):
    root = _write(tmp_path / "cg", memory_max="max", memory_current=str(900 * MIB))
    proc = _proc_cgroup(tmp_path, "0::/")
    assert cgroup_headroom(root, proc) is None
    meminfo = _meminfo(tmp_path, 300 * 1024)  # 300 MiB
    got = available_memory(cgroup_root=root, meminfo=meminfo, proc_cgroup=proc)
    assert got is not None and got <= 300 * MIB
    assert mem_available(meminfo) == 300 * MIB


def test_a_parent_cgroup_limit_binds_the_process_cgroup(tmp_path):
    root = _write(tmp_path / "cg", memory_max="max", memory_current="0")
    _write(root / "batch", memory_max=str(2 * GIB), memory_current=str(GIB + 512 * MIB))
    _write(root / "batch" / "job7", memory_max="max", memory_current=str(100 * MIB))
    proc = _proc_cgroup(tmp_path, "0::/batch/job7")
    assert cgroup_headroom(root, proc) == 512 * MIB


def test_the_process_cgroup_missing_under_the_root_falls_back_to_its_parents(tmp_path):
    root = _write(tmp_path / "cg", memory_max=str(3 * GIB), memory_current=str(GIB))
    proc = _proc_cgroup(tmp_path, "0::/not/mounted/here")
    assert cgroup_headroom(root, proc) == 2 * GIB


def test_cgroup_v1_limit_less_usage_bounds_available_memory(tmp_path):
    root = tmp_path / "cg"
    _write(root / "memory", memory_limit_in_bytes=str(2**63 - 4096), memory_usage_in_bytes="1")
    _write(
        root / "memory" / "docker" / "abc",
        memory_limit_in_bytes=str(512 * MIB),
        memory_usage_in_bytes=str(500 * MIB),
    )
    proc = _proc_cgroup(tmp_path, "4:memory:/docker/abc", "3:cpu,cpuacct:/docker/abc", "0::/")
    assert cgroup_headroom(root, proc) == 12 * MIB
    meminfo = _meminfo(tmp_path, 64 * GIB // 1024)
    got = available_memory(cgroup_root=root, meminfo=meminfo, proc_cgroup=proc)
    assert got is not None and got <= 12 * MIB


def test_cgroup_v1_unlimited_value_sets_no_limit(tmp_path):
    root = tmp_path / "cg"
    _write(root / "memory", memory_limit_in_bytes=str(2**63 - 4096), memory_usage_in_bytes=str(GIB))
    assert cgroup_headroom(root, _proc_cgroup(tmp_path, "4:memory:/")) is None


def test_usage_above_the_limit_leaves_no_room(tmp_path):
    root = _write(tmp_path / "cg", memory_max=str(GIB), memory_current=str(GIB + 1))
    assert cgroup_headroom(root, _proc_cgroup(tmp_path, "0::/")) == 0


def test_no_cgroup_files_set_no_cgroup_limit(tmp_path):
    (tmp_path / "empty").mkdir()
    assert cgroup_headroom(tmp_path / "empty", tmp_path / "no_such_file") is None


_RLIMIT_CHILD = textwrap.dedent(
    """
    import json, os, resource, sys

    from recaccel.errors import ConfigError
    from recaccel.ops.embedding.cache.host_store import available_host_memory, check_host_memory
    from recaccel.ops.embedding.packing import PackingPlan
    from recaccel.ops.embedding.specs import TableSpec

    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * page
    room = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (used + room, resource.getrlimit(resource.RLIMIT_AS)[1]))
    # 4M rows of dim 16 plus a row-wise state: about 272 MiB, more than the room left
    layouts = PackingPlan([TableSpec("t", 4_000_000, 16, placement="host")]).packs
    try:
        check_host_memory(layouts)
        refused = None
    except ConfigError as e:
        refused = str(e)
    print(json.dumps({"available": available_host_memory(), "refused": refused}))
    """
)


def test_rlimit_as_bounds_the_host_memory_check_in_a_child_process(tmp_path):
    room = 128 * MIB
    done = subprocess.run(
        [sys.executable, "-c", _RLIMIT_CHILD, str(room)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 <= out["available"] <= room
    assert out["refused"] is not None
    assert "model.embedding_placement" in out["refused"] and "host memory" in out["refused"]
