"""recaccel.io, io.format and io.convert name their public API; importing them, the schema,
the writer or the Criteo converter loads no torch (converters run without a GPU stack)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["recaccel.io.format", "recaccel.io.convert"]


def test_light_imports_load_no_torch():
    probe = (
        "import sys; import recaccel.io, recaccel.io.format, recaccel.io.convert; "
        "import recaccel.io.format.schema, recaccel.io.format.writer, recaccel.io.format.grouping; "
        "import recaccel.io.convert.criteo; "
        "print('torch' in sys.modules, sorted(m for m in sys.modules if m.startswith('recaccel.io.readers')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False []"


@pytest.mark.parametrize("name", PACKAGES)
def test_every_listed_name_resolves_to_its_module(name):
    package = importlib.import_module(name)
    submodules = {attr for attr in package.__all__ if attr not in package._EXPORTS}
    assert submodules == ({"group_by_task"} if name.endswith("convert") else set())
    for attr in package.__all__:
        if attr in submodules:
            assert importlib.import_module(f"{name}.{attr}") is getattr(package, attr)
            continue
        defining = importlib.import_module(f"{name}.{package._EXPORTS[attr]}")
        assert getattr(package, attr) is getattr(defining, attr), attr
    assert set(package._EXPORTS) <= set(package.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        package.nothing  # noqa: B018


def test_io_names_its_parts():
    io = importlib.import_module("recaccel.io")
    for attr in io.__all__:
        importlib.import_module(f"recaccel.io.{attr}")
    assert io.__all__ == ["convert", "format", "host_buffer", "loader", "readers"]
