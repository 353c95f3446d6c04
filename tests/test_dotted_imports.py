"""Every recaccel module imports by its dotted path as ``import a.b.c as x``.

That form walks the attributes ``a.b`` then ``.c``, so a name a package ``__init__``
binds over a subpackage (``recaccel.train``, the API function, once hid the package)
breaks it even though ``import a.b.c`` alone works. The imports run in one child
process, so modules with import-time side effects leave this one untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Extras in pyproject.toml: a module needing one of these is skipped where it is absent.
OPTIONAL = {"torchrec", "fbgemm_gpu", "nvidia", "matplotlib"}

# Runs modules as scripts (argument parsing, exit statuses) rather than defining any.
SCRIPTS = {"__main__"}

IMPORT_ALL = """
import json, sys
out = {}
for name in sys.argv[1:]:
    try:
        exec(f"import {name} as _m")
        out[name] = None
    except BaseException as e:  # noqa: BLE001 - every failure is reported by name
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        out[name] = {"error": f"{type(e).__name__}: {e}", "missing": missing}
print(json.dumps(out))
"""


def _module_names() -> list[str]:
    names = []
    for path in sorted((ROOT / "recaccel").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] in SCRIPTS:
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _module_names()


@pytest.fixture(scope="module")
def import_results() -> dict[str, dict | None]:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_walk_finds_the_train_loop_modules() -> None:
    assert "recaccel.train.loop.trainer" in MODULES
    assert "recaccel.train" in MODULES
    assert len(MODULES) > 100


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_by_dotted_path_as_alias(name: str, import_results: dict) -> None:
    failure = import_results[name]
    if failure is not None and (failure["missing"] or "").split(".")[0] in OPTIONAL:
        pytest.skip(f"{name} needs the optional package {failure['missing']}")
    assert failure is None, f"import {name} as x: {failure and failure['error']}"


def test_recaccel_train_is_the_package_with_the_api_functions_signature() -> None:
    import inspect

    import recaccel
    import recaccel.api
    import recaccel.train.loop.trainer as trainer

    assert trainer.__name__ == "recaccel.train.loop.trainer"
    assert recaccel.train.loop.trainer is trainer
    assert inspect.signature(recaccel.train) == inspect.signature(recaccel.api.train)
    assert callable(recaccel.train)
