"""A pre-decoded dataset cache: a Parquet dataset's decoded, validated columns in
memory-mappable files, so repeated epochs skip Parquet decoding.

:mod:`~recaccel.io.format.cache.manifest` (``cache.json`` and its checks),
:mod:`~recaccel.io.format.cache.build` (``recaccel-data cache SRC DST``) and
:mod:`~recaccel.io.format.cache.read` (the cached row-group reader). A folder holding
``cache.json`` given to :func:`~recaccel.io.format.dataset.open_dataset` (``data.train``,
``data.eval``) reads from the cache.
"""
