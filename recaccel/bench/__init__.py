"""Benchmarks behind ``recaccel-bench``: each compares against a baseline timed in the
same run (interleaved, median of many repeats) and writes markdown, JSON and a plot.

:data:`BENCHMARKS` maps a benchmark's name to ``(help, add_args, main)``; a benchmark's
module (and torch) is imported only when it runs.
"""

from recaccel.bench.harness.registry import BENCHMARKS

__all__ = ["BENCHMARKS"]
