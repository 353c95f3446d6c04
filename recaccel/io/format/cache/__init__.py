"""A pre-decoded dataset cache: a Parquet dataset's decoded, validated columns in
memory-mappable files, so repeated epochs skip Parquet decoding.

:mod:`~recaccel.io.format.cache.manifest` (``cache.json`` and its checks),
:mod:`~recaccel.io.format.cache.build` (``recaccel-data cache SRC DST``) and
:mod:`~recaccel.io.format.cache.read` (the cached row-group reader). A folder holding
``cache.json`` given to :func:`~recaccel.io.format.dataset.open_dataset` (``data.train``,
``data.test``) reads from the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recaccel.lazy import lazy_exports

if TYPE_CHECKING:
    from recaccel.io.format.cache.build import CacheReport, build_cache
    from recaccel.io.format.cache.manifest import is_cache, load_manifest
    from recaccel.io.format.cache.read import CachedRowGroupReader

# Each public name and the submodule defining it (imported on first use: the reading side
# is imported by the dataset module, which the build imports).
_EXPORTS = {
    "CacheReport": "build",
    "build_cache": "build",
    "is_cache": "manifest",
    "load_manifest": "manifest",
    "CachedRowGroupReader": "read",
}

__all__ = ["CacheReport", "CachedRowGroupReader", "build_cache", "is_cache", "load_manifest"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
