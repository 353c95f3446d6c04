"""Offline converters: public datasets to recaccel Parquet, and the task-grouping rewrite.

:func:`generate_synthetic` (a planted-model CTR dataset), :func:`convert_criteo`
(Criteo TSV), :func:`convert_movielens` (MovieLens 100K, cold-start splits),
:func:`convert_melu` (the MeLU paper's MovieLens states) and the
:mod:`~recaccel.io.convert.group_by_task` package (its function of that name rewrites any
dataset sorted by task key, for the task reader; the package name is the module, which
would shadow a function of the same name). Each imports only
:mod:`recaccel.io.format` and the modules at the bottom of the package (config, errors,
hashing, metrics, sparse): never a reader, nor another converter.

Names resolve on first use, so importing one converter does not import the others
(``recaccel.io.convert.criteo`` stays torch-free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recaccel.lazy import lazy_exports

if TYPE_CHECKING:
    from recaccel.io.convert.criteo import CriteoReport, convert_criteo, criteo_schema
    from recaccel.io.convert.group_by_task import GroupReport
    from recaccel.io.convert.melu import MeluReport, convert_melu, melu_schema
    from recaccel.io.convert.movielens import MovieLensReport, convert_movielens, movielens_schema
    from recaccel.io.convert.synth import SynthReport, generate_synthetic, synth_schema

# Each public name and the submodule defining it (imported on first use).
_EXPORTS = {
    "generate_synthetic": "synth",
    "synth_schema": "synth",
    "SynthReport": "synth",
    "convert_criteo": "criteo",
    "criteo_schema": "criteo",
    "CriteoReport": "criteo",
    "convert_movielens": "movielens",
    "movielens_schema": "movielens",
    "MovieLensReport": "movielens",
    "convert_melu": "melu",
    "melu_schema": "melu",
    "MeluReport": "melu",
    "GroupReport": "group_by_task",
}

__all__ = [
    "CriteoReport",
    "GroupReport",
    "MeluReport",
    "MovieLensReport",
    "SynthReport",
    "convert_criteo",
    "convert_melu",
    "convert_movielens",
    "criteo_schema",
    "generate_synthetic",
    "group_by_task",
    "melu_schema",
    "movielens_schema",
    "synth_schema",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
