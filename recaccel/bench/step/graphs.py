"""The train benchmark's CUDA-graph settings, as its combinations and result rows name them
(no torch: the GPU check's target table reads the rows with it)."""

from __future__ import annotations

# --cuda-graphs values: none | the dense head (train.cuda_graphs, cuda_graph_scope = head) |
# the whole step (cuda_graph_scope = step).
GRAPHS = ("off", "on", "step")


def graphs_label(value: object) -> str:
    """A row's ``cuda_graphs`` as ``off`` / ``on`` / ``step`` (results written before the
    whole-step graph held a bool)."""
    if isinstance(value, str):
        return value
    return "on" if value else "off"
