"""Operator benchmarks: embedding bags, the Triton kernel sweep, dot and DCN-v2 interaction,
the dense MLP."""

__all__: list[str] = []
