"""Package attributes that import their submodule on first use (PEP 562).

A package whose ``__init__`` names its public API this way stays cheap to import: its
heavy submodules (torch, TorchRec) load only when one of their names is used.

Example::

    _EXPORTS = {"Trainer": "trainer"}          # name -> submodule of this package
    __all__ = ["Trainer"]
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        exports: each public name and the submodule (relative to ``package``) defining it.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
