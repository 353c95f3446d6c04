"""Reading a checkpoint's payload as untrusted input, and checking it against the run.

A run directory may come from anywhere, so nothing in it may run code or end in a
traceback. Every problem is one :class:`CheckpointError` line that names the checkpoint
and what is wrong:

- :func:`read_payload` unpickles with ``torch.load(weights_only=True)`` (tensors,
  numbers, strings, containers) and turns a refused global into one line;
- :func:`check_entries`, :func:`check_module_state`, :func:`check_optimizer_state`
  validate a payload against the run before anything is applied.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor, nn

from recaccel.train.checkpoint.digests import verify_file
from recaccel.train.checkpoint.errors import CheckpointError, first_line, refusal, show
from recaccel.train.checkpoint.paths import digest_file

logger = logging.getLogger(__name__)
# Entries every checkpoint carries (newer optional entries are checked where they are restored).
STATE_KEYS = ("step", "epoch", "samples", "train_seconds", "reader", "rng")


# ------------------------------------------------------------------ unpickling


def read_payload(source: str | os.PathLike | BinaryIO, path: str | os.PathLike, device: Any = "cpu") -> Any:
    """``torch.load(source, weights_only=True)`` with one-line errors naming ``path``.

    A file (``source`` a path) is first verified by :func:`verify_file`; one without a
    digest file is logged as a warning once it has loaded.

    Raises:
        CheckpointError: the file fails its checksum, is unreadable, truncated, or its
            pickle asks for anything but tensors, numbers, strings and containers.
    """
    sealed = verify_file(Path(source), path) if isinstance(source, (str, os.PathLike)) else True
    try:
        payload = torch.load(source, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(path, f"not a recaccel checkpoint ({refusal(e)})") from None
    except Exception as e:  # truncated zip, foreign format, unreadable file
        raise CheckpointError(path, f"cannot be read ({type(e).__name__}: {first_line(e)})") from None
    if not sealed:
        logger.warning(
            "checkpoint %s has no %s digest file (written before recaccel recorded them, or copied "
            "without it): only its zip CRC-32s were checked",
            path,
            digest_file(Path(source)).name,
        )
    return payload


# ---------------------------------------------------------------- validation


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_entries(
    path: Path, entries: Any, required: tuple[str, ...] = STATE_KEYS, entry: str | None = None
) -> None:
    """Checks a checkpoint's training-state entries (see ``checkpoint.state_entries``).

    ``step``/``epoch``/``samples`` must be non-negative ints, ``train_seconds`` a finite
    non-negative number, ``reader`` a JSON string of an object or null, ``rng`` the
    generator states of :func:`check_rng`. Other keys are left to their readers.
    ``entry``: the checkpoint entry holding them (a sharded checkpoint's ``ranks.<r>``).

    Raises:
        CheckpointError: naming the first missing or bad entry.
    """
    if not isinstance(entries, dict):
        what = f"entry {entry!r} must be a dict" if entry else "not a recaccel checkpoint (not a dict"
        raise CheckpointError(path, f"{what}, it holds {type(entries).__name__}" + ("" if entry else ")"))
    missing = [k for k in required if k not in entries]
    if missing:
        where = f"entry {entry!r} lacks" if entry else "not a recaccel checkpoint: missing entry"
        raise CheckpointError(path, f"{where} {missing[0]!r}")
    prefix = f"{entry}." if entry else ""
    for key in ("step", "epoch", "samples"):
        if key in entries and not is_count(entries[key]):
            raise CheckpointError(
                path, f"entry '{prefix}{key}' must be a non-negative int, got {show(entries[key])}"
            )
    seconds = entries.get("train_seconds", 0.0)
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise CheckpointError(
            path, f"entry '{prefix}train_seconds' must be a finite number >= 0, got {show(seconds)}"
        )
    if "reader" in entries:
        check_reader_json(path, entries["reader"], f"{prefix}reader")
    if "rng" in entries:
        check_rng(path, entries["rng"], f"{prefix}rng")


def check_reader_json(path: Path, text: Any, entry: str = "reader") -> None:
    """The reader position must be JSON text of an object (or null)."""
    if not isinstance(text, str):
        raise CheckpointError(path, f"entry {entry!r} must be JSON text, got {show(text)}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(path, f"entry {entry!r} is not valid JSON ({first_line(e)})") from None
    if value is not None and not isinstance(value, dict):
        raise CheckpointError(path, f"entry {entry!r} must hold a JSON object or null, got {show(value)}")


def check_rng(path: Path, rng: Any, entry: str = "rng") -> None:
    """Tries each saved generator state on a fresh generator, so a bad one is reported
    here instead of failing (or silently half-applying) when the global ones are set."""
    if not isinstance(rng, dict):
        raise CheckpointError(path, f"entry {entry!r} must be a dict of generator states, got {show(rng)}")
    for key in ("torch", "python", "numpy"):
        if key not in rng:
            raise CheckpointError(path, f"entry {entry!r} lacks the {key!r} generator state")
    checks: dict[str, Callable[[Any], None]] = {
        "torch": _try_torch_rng,
        "python": _try_python_rng,
        "numpy": _try_numpy_rng,
    }
    for key, check in checks.items():
        try:
            check(rng[key])
        except (TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError) as e:
            what = f"entry '{entry}.{key}' is not a generator state ({first_line(e)})"
            raise CheckpointError(path, what) from None
    cuda = rng.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, (list, tuple))
        and all(isinstance(s, Tensor) and s.dtype == torch.uint8 for s in cuda)
    ):
        raise CheckpointError(path, f"entry '{entry}.cuda' must be a list of uint8 tensors, got {show(cuda)}")


def _try_torch_rng(state: Any) -> None:
    if not isinstance(state, Tensor):
        raise TypeError(f"expected a uint8 tensor, got {show(state)}")
    torch.Generator().set_state(state.detach().cpu())


def python_rng_state(text: str) -> tuple:
    """The ``random.getstate()`` tuple saved as JSON text (JSON turned its tuple into a list)."""
    version, internal, gauss = json.loads(text)
    return version, tuple(internal), gauss


def _try_python_rng(text: Any) -> None:
    if not isinstance(text, str):
        raise TypeError(f"expected JSON text, got {show(text)}")
    random.Random().setstate(python_rng_state(text))


def _try_numpy_rng(text: Any) -> None:
    if not isinstance(text, str):
        raise TypeError(f"expected JSON text, got {show(text)}")
    state = json.loads(text)
    if not isinstance(state, dict):
        raise TypeError(f"expected a JSON object, got {show(state)}")
    np.random.RandomState().set_state(state)


def check_module_state(path: Path, entry: str, module: nn.Module, saved: Any) -> None:
    """``saved`` must have exactly ``module``'s state keys, with tensors of the same shape and
    dtype, and no NaN (a NaN weight was resumed into a run that then reported a diverged
    model, and exported as it was).

    Raises:
        CheckpointError: naming the first missing, unexpected, mismatched or NaN-holding key.
    """
    if not isinstance(saved, dict):
        raise CheckpointError(path, f"entry {entry!r} must be a state dict, got {show(saved)}")
    expected = module.state_dict()
    for key, now in expected.items():
        if key not in saved:
            raise CheckpointError(path, f"entry {entry!r} lacks key {key!r} of this model")
        value = saved[key]
        if isinstance(now, Tensor) and not (
            isinstance(value, Tensor) and value.shape == now.shape and value.dtype == now.dtype
        ):
            raise CheckpointError(
                path, f"entry {entry!r} key {key!r} is {show(value)}, this model has {show(now)}"
            )
        check_finite(path, f"entry {entry!r} key {key!r}", value)
    unexpected = [k for k in saved if k not in expected]
    if unexpected:
        raise CheckpointError(path, f"entry {entry!r} has key {unexpected[0]!r}, which this model lacks")


_NAN_CHUNK = 1 << 24  # elements tested at a time: a bounded temporary beside the loaded payload


def check_finite(path: Path, what: str, value: Any) -> None:
    """Raises CheckpointError naming ``what`` when ``value`` is a floating-point tensor
    holding NaN (what no step of a healthy run saves). Infinities pass: a model may keep
    them on purpose (an attention mask buffer of -inf). Tested in chunks, so the check's
    temporary stays small however large the table.
    """
    if type(value) not in (Tensor, nn.Parameter) or not value.is_floating_point():
        return  # not a plain dense tensor (a sharded one is checked where it is whole)
    chunks = value.reshape(-1).split(_NAN_CHUNK)
    for k, chunk in enumerate(chunks):
        if bool(torch.isnan(chunk).any()):  # counted from here on: the chunks before hold none
            bad = sum(int(torch.isnan(c).sum()) for c in chunks[k:])
            raise CheckpointError(path, f"{what} holds {bad} NaN values of {value.numel()}")


def check_optimizer_state(
    path: Path, entry: str, optimizer: torch.optim.Optimizer, saved: Any, *, rowwise: bool = False
) -> None:
    """``saved`` must be a ``state_dict()`` of an optimizer like ``optimizer``: as many
    groups of as many parameters, hyper-parameters of the same kinds, and per-parameter
    tensors shaped like their parameter or scalars (``rowwise``: also one value per row).

    Raises:
        CheckpointError: naming the first bad group, parameter or value.
    """
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("state"), dict)
        and isinstance(saved.get("param_groups"), list)
    ):
        raise CheckpointError(
            path, f"entry {entry!r} must be an optimizer state dict with 'state' and 'param_groups'"
        )
    params = _saved_params(path, entry, optimizer, saved["param_groups"])
    for pid, states in saved["state"].items():
        if pid not in params:
            raise CheckpointError(path, f"entry {entry!r} has state for unknown parameter {pid!r}")
        if not isinstance(states, dict):
            raise CheckpointError(path, f"entry {entry!r} state[{pid!r}] must be a dict, got {show(states)}")
        shape = tuple(params[pid].shape)
        fits = {shape, ()} | ({shape[:1], (*shape[:1], 1)} if rowwise and shape else set())
        for name, value in states.items():
            ok = (
                (tuple(value.shape) in fits)
                if isinstance(value, Tensor)
                else (value is None or (isinstance(value, (int, float)) and math.isfinite(value)))
            )
            if not ok:
                what = f"state[{pid!r}][{name!r}] is {show(value)}, parameter shape {list(shape)}"
                raise CheckpointError(path, f"entry {entry!r} {what}")
            check_finite(path, f"entry {entry!r} state[{pid!r}][{name!r}]", value)


def _saved_params(
    path: Path, entry: str, optimizer: torch.optim.Optimizer, groups: list[Any]
) -> dict[int, Tensor]:
    """Checks saved parameter groups against ``optimizer``'s; returns saved id -> parameter."""
    current = optimizer.state_dict()["param_groups"]
    if len(groups) != len(current):
        raise CheckpointError(
            path, f"entry {entry!r} has {len(groups)} parameter groups, this optimizer has {len(current)}"
        )
    params: dict[int, Tensor] = {}
    for i, (group, now, live) in enumerate(zip(groups, current, optimizer.param_groups)):
        where = f"entry {entry!r} param_groups[{i}]"
        ids = group.get("params") if isinstance(group, dict) else None
        if not (isinstance(ids, list) and len(ids) == len(now["params"]) and all(is_count(j) for j in ids)):
            raise CheckpointError(path, f"{where} must list {len(now['params'])} parameter ids")
        for key, value in now.items():
            if key != "params" and key in group and not _same_kind(value, group[key]):
                raise CheckpointError(path, f"{where} {key!r} is {show(group[key])}, expected like {value!r}")
        missing = [k for k in now if k in _RULE_KEYS and k not in group]
        if missing:  # loaded, the groups would lack what this optimizer's step reads: a KeyError there
            raise CheckpointError(
                path,
                f"{where} has no {missing[0]!r}: it holds another optimizer's state than this run's "
                f"{type(optimizer).__name__} (was optim.dense changed since the checkpoint?)",
            )
        params.update(zip(ids, live["params"]))
    return params


# Hyper-parameters an optimizer's update reads from its groups, which torch's load_state_dict
# does not fill in when a saved group lacks them (it does for flags added by newer versions,
# such as foreach or maximize): one missing means the state is another optimizer's.
_RULE_KEYS = frozenset(
    {"lr", "betas", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value"}
)


def _same_kind(now: Any, saved: Any) -> bool:
    """Whether a saved optimizer hyper-parameter can stand where ``now`` stands."""
    if isinstance(now, bool):
        return isinstance(saved, bool)
    if now is None:  # e.g. foreach / fused: unset, or chosen
        return saved is None or isinstance(saved, bool)
    if isinstance(now, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(now, (tuple, list)):
        return (
            isinstance(saved, (tuple, list))
            and len(saved) == len(now)
            and all(_same_kind(a, b) for a, b in zip(now, saved))
        )
    return type(saved) is type(now)


def apply_state(path: Path, entry: str, load: Callable[[Any], Any], saved: Any) -> None:
    """``load(saved)`` (a ``load_state_dict``) with what the checks above cannot foresee
    reported in one line."""
    try:
        load(saved)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(path, f"entry {entry!r} does not fit this run ({first_line(e)})") from None
