"""Embedding cache benchmarks: hit-rate simulation of policies on id traces, training with
host-placed tables behind the cache."""

__all__: list[str] = []
