"""Backend-independent checkpoints of a packed embedding bag.

Whatever the packing and backend, the state dict holds per table ``<table>.weight``
[R, D] and the table's optimizer state (``<table>.momentum1``, ``<table>.momentum2``,
``<table>.step``), so a checkpoint written by one backend loads in another, and a change
of packing (new tables of another dim) leaves the other tables' keys unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from recaccel.ops.embedding.rounding import StochasticRounding

# Per table name: its tensors by checkpoint name (``weight``, ``momentum1``, ...), views
# of the module's packed state (PackedEmbeddingBag.table_states()).
TableStates = Mapping[str, Mapping[str, Tensor]]
# State-dict key (after the module's prefix) of the stochastic-rounding generator of
# 16-bit rows; it has no dot, so no table's ``<table>.<name>`` key can take it.
ROUNDING_KEY = "rounding_generator"


def save_tables(table_states: TableStates, destination: dict, prefix: str) -> None:
    """Writes every table's rows and optimizer state under ``prefix``.

    Rows are views of the packed buffers (``torch.save`` stores each buffer once);
    ``step`` is a copy, a snapshot of the pack's counter.
    """
    for table_name, tensors in table_states.items():
        for name, tensor in tensors.items():
            destination[f"{prefix}{table_name}.{name}"] = (
                tensor.clone() if name == "step" else tensor.detach()
            )


def load_tables(
    table_states: TableStates,
    state_dict: dict,
    prefix: str,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Copies every table's rows and optimizer state from ``state_dict`` into ``table_states``
    (views of the packs, so into the packs).

    Follows ``nn.Module._load_from_state_dict``'s contract: absent keys go to
    ``missing_keys``, keys under ``prefix`` that no table owns to ``unexpected_keys``
    (when ``strict``), shape mismatches and rows of another dtype (16-bit vs float32:
    never cast silently) to ``error_msgs``. Tables sharing a pack share its
    Adam step, which becomes the largest step of its tables in the checkpoint.
    """
    expected: set[str] = set()
    steps: dict[int, tuple[Tensor, int]] = {}
    for table_name, tensors in table_states.items():
        for name, target in tensors.items():
            key = f"{prefix}{table_name}.{name}"
            expected.add(key)
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if not isinstance(value, Tensor):
                error_msgs.append(f"{key}: expected a tensor, got {type(value).__name__}")
                continue
            if name == "weight" and value.dtype != target.dtype:
                error_msgs.append(
                    f"{key}: the checkpoint holds {value.dtype} rows but this model's are {target.dtype} "
                    "(model.embedding_dtype must be the checkpoint's; rows are never cast on load)"
                )
                continue
            if value.shape != target.shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a tensor of shape {tuple(value.shape)} from the "
                    f"checkpoint, the shape in the current model is {tuple(target.shape)}"
                )
                continue
            if name == "step":
                _, best = steps.get(id(target), (target, -1))
                steps[id(target)] = (target, max(best, int(value)))
                continue
            with torch.no_grad():
                target.copy_(value)
    for target, step in steps.values():
        target.fill_(step)
    if strict:
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)


def load_rounding(
    rounding: StochasticRounding | None,
    state_dict: dict,
    prefix: str,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
) -> dict:
    """Loads the rounding generator's state into ``rounding`` (16-bit rows) and returns the
    state dict without it (the tables' entries), noting a missing or unexpected key."""
    key = prefix + ROUNDING_KEY
    if key not in state_dict:
        if rounding is not None:
            missing_keys.append(key)
        return state_dict
    if rounding is not None:
        rounding.load_state(state_dict[key])
    elif strict:
        unexpected_keys.append(key)
    return {k: v for k, v in state_dict.items() if k != key}
