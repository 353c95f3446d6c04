"""The tiny train-benchmark preset the benchmark tests run."""

from __future__ import annotations

# A preset small enough for every candidate of `recaccel-bench train` to run in seconds on CPU.
TINY_PRESET = """
[synth]
num_dense = 3
num_sparse = 4
cardinality = 40
multi_hot_fields = 1
max_bag = 3
rows_per_row_group = 64
[data]
batch_size = 32
[model]
embedding_dim = 8
bottom_mlp = [16, 8]
top_mlp = [16, 1]
"""
