"""Argument and saved-state checks shared by the resumable readers (BatchReader, TaskReader)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

from recaccel.errors import ConfigError, DataError
from recaccel.io.format.dataset import DatasetInfo
from recaccel.io.format.decode import Policies

T = TypeVar("T")

# Fingerprint keys that describe the data rather than the settings.
_DATA_KEYS = ("num_row_groups", "num_rows")


def data_fingerprint(info: DatasetInfo, policies: Policies) -> dict[str, Any]:
    """The read policies and dataset sizes a saved position depends on (JSON-able)."""
    return {
        "policies": [policies.invalid_ids, policies.invalid_dense, policies.invalid_labels],
        "num_row_groups": len(info.row_groups),
        "num_rows": info.num_rows,
    }


def with_last(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """Each item of ``items`` with whether it is the last, reading one item ahead: how a
    reader knows that the state after a batch is the epoch's end."""
    pending = next(items, _NOTHING)
    while pending is not _NOTHING:
        following = next(items, _NOTHING)
        yield pending, following is _NOTHING
        pending = following


_NOTHING = object()


def epoch_done(state: Any) -> bool:
    """Whether a reader state (of any resumable reader) was taken after its epoch's last
    batch: the next iteration from it starts the next epoch."""
    return isinstance(state, dict) and state.get("epoch_done") is True


def saved_counters(state: Any) -> dict[str, int] | None:
    """The reader counters paired with a reader state (None when it carries none)."""
    counters = state.get("counters") if isinstance(state, dict) else None
    return dict(counters) if isinstance(counters, dict) else None


def counters_at(stats: dict[str, int], reread: dict[str, int] | None = None) -> dict[str, int]:
    """The counters to pair with a position: ``stats`` less ``reread``, the increments of
    the input a resume from that position reads again (its partly consumed shuffle buffer
    or task window), so a resumed reader's counters end equal to an uninterrupted one's.
    High-water marks (``max_*``) are kept as they are."""
    out = dict(stats)
    for key, value in (reread or {}).items():
        if not key.startswith("max_"):
            out[key] = out.get(key, 0) - value
    return out


def restore_counters(state: dict[str, Any], stats: dict[str, int], what: str) -> None:
    """Sets ``stats`` to the counters saved in ``state`` (kept as they are when the state
    predates saved counters).

    Raises:
        ConfigError: if the saved counters are not a dict of non-negative ints.
    """
    if "counters" not in state:
        return
    counters = state["counters"]
    if not are_counters(counters):
        raise ConfigError(f"{what} state has bad counters: {counters!r}")
    set_counters(stats, counters)


def are_counters(value: Any) -> bool:
    """Whether ``value`` is a dict of counter names to non-negative ints (saved counters)."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in value.items()
    )


def set_counters(stats: dict[str, int], counters: dict[str, int]) -> None:
    """Makes the counter dict ``stats`` (in place) equal ``counters`` (missing keys 0)."""
    for key in stats:
        stats[key] = 0
    stats.update(counters)


def restore_position(
    state: Any, version: int, fingerprint: dict[str, Any], keys: tuple[str, ...], what: str
) -> tuple[list[int], bool]:
    """Validates a reader's saved ``state`` and returns its position.

    Args:
        state: the dict from the reader's ``state_dict()``.
        version: the state format version the reader writes.
        fingerprint: the reader's current settings; each must equal the saved one.
        keys: the position fields, each a non-negative int.
        what: the reader's name for messages.

    Returns:
        The position fields in ``keys`` order, and ``epoch_done``.

    Raises:
        ConfigError: if the state is malformed or a setting differs.
        DataError: if it was taken on a dataset with other row groups.
    """
    if not isinstance(state, dict) or state.get("version") != version or not all(k in state for k in keys):
        raise ConfigError(
            f"{what} state must be a dict with version {version} and {list(keys)}, got {state!r}"
        )
    for key, now in fingerprint.items():
        saved = state.get(key)
        if saved != now:
            err = DataError if key in _DATA_KEYS else ConfigError
            raise err(f"reader state was saved with {key}={saved!r}, but this reader has {key}={now!r}")
    fields = [state[k] for k in keys]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields):
        raise ConfigError(f"{what} state has a bad position: {state!r}")
    return fields, bool(state.get("epoch_done", False))
