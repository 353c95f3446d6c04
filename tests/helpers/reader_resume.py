"""A reader's position after its first batches, and the rest of the epoch read from it."""

from __future__ import annotations

from typing import Any


def position_after(reader, batches: int) -> dict[str, Any]:
    """The reader's position after its first ``batches`` batches (the iteration abandoned then)."""
    it = reader.iter_with_state()
    for _ in range(batches):
        _, state = next(it)
    it.close()
    return state


def rest_from(reader, state: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
    """(batch, position) of every batch ``reader`` reads after resuming at ``state``."""
    reader.load_state_dict(state)
    return list(reader.iter_with_state())
