"""Reading checkpoints as untrusted input, and writing them durably.

A run directory may come from anywhere, so nothing in it may run code or end in a
traceback. Every problem is one :class:`~recaccel.errors.RecaccelError` line that names
the checkpoint and what is wrong:

- :func:`read_payload` unpickles with ``torch.load(weights_only=True)`` (tensors,
  numbers, strings, containers) and turns a refused global into one line;
- :func:`check_entries`, :func:`check_module_state`, :func:`check_optimizer_state`
  validate a payload against the run before anything is applied;
- :class:`SafeDCPReader` / :class:`SafeDCPPlanner` read a ``torch.distributed.checkpoint``
  folder with its ``.metadata`` pickle restricted to DCP's own metadata classes and its
  byte entries restricted like :func:`read_payload`;
- :func:`verify_file` / :func:`verify_digests` check a checkpoint's bytes against the
  SHA-256s recorded when it was written (a file without one: its zip CRC-32s), so a
  bit flip on disk is refused instead of loaded as changed weights;
- :func:`fsync_path` / :func:`fsync_tree` make a written checkpoint durable before it is
  renamed into place.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import pickle
import random
import re
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor, nn

from recaccel.errors import RecaccelError
from recaccel.train.checkpoint_paths import INFO_FILE, digest_file

logger = logging.getLogger(__name__)
# Entries every checkpoint carries (newer optional entries are checked where they are restored).
STATE_KEYS = ("step", "epoch", "samples", "train_seconds", "reader", "rng")
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_TORCH_HINTS = ("weights_only", "torch.load", "in pytorch 2.", "weightsunpickler", "check the documentation")


class CheckpointError(RecaccelError):
    """A checkpoint is unreadable, unsafe or does not fit the run: ``checkpoint <path>: <what>``."""

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        super().__init__(f"checkpoint {path}: {what}")
        self.path = Path(path)
        self.what = what

    def __reduce__(self) -> tuple:  # DCP copies errors between ranks by pickling them
        return (type(self), (str(self.path), self.what))


# ------------------------------------------------------------------ unpickling


def first_line(error: BaseException) -> str:
    """The first line of an exception's message that is not one of torch's hints."""
    for line in str(error).splitlines():
        line = line.strip()
        if line and not any(h in line.lower() for h in _TORCH_HINTS):
            if len(line) > 120 and ". " in line:  # torch's long messages: their first sentence
                line = line[: line.index(". ")]
            return line if len(line) <= 200 else line[:197] + "..."
    return type(error).__name__


def refusal(error: pickle.UnpicklingError) -> str:
    """Why a restricted unpickler refused a file, without torch's advice to lift the restriction."""
    found = _GLOBAL.search(str(error))
    if found:
        return f"refused to unpickle global {found.group(1)!r}"
    return f"refused to unpickle it: {first_line(error)}"


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


def show(value: Any) -> str:
    """A short one-line description of a checkpoint value."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} {text[:50]}..."


def _is_count(value: Any) -> bool:
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
        if key in entries and not _is_count(entries[key]):
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
    """``saved`` must have exactly ``module``'s state keys, with tensors of the same shape and dtype.

    Raises:
        CheckpointError: naming the first missing, unexpected or mismatched key.
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
    unexpected = [k for k in saved if k not in expected]
    if unexpected:
        raise CheckpointError(path, f"entry {entry!r} has key {unexpected[0]!r}, which this model lacks")


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
        if not (isinstance(ids, list) and len(ids) == len(now["params"]) and all(_is_count(j) for j in ids)):
            raise CheckpointError(path, f"{where} must list {len(now['params'])} parameter ids")
        for key, value in now.items():
            if key != "params" and key in group and not _same_kind(value, group[key]):
                raise CheckpointError(path, f"{where} {key!r} is {show(group[key])}, expected like {value!r}")
        params.update(zip(ids, live["params"]))
    return params


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


# ----------------------------------------------------------- DCP, restricted

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Everything else a DCP .metadata pickle of this project names (listed with pickletools).
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "WindowsPath"),
    ("pathlib._local", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes, tensor dtypes and the few helpers they pickle with."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_METADATA:
            import torch.distributed.checkpoint.metadata as metadata

            obj = getattr(metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == _DCP_METADATA:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        what = f"not a recaccel checkpoint (refused to unpickle global '{module}.{name}')"
        raise CheckpointError(self.path, what)


def read_dcp_metadata(path: Path) -> Any:
    """A DCP ``.metadata`` file through :class:`_MetadataUnpickler`, checked to be a
    ``Metadata`` whose data files lie inside its folder.

    Raises:
        CheckpointError: an unreadable or foreign file, a refused global, or a bad layout.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated, or not a pickle
        raise CheckpointError(path, f"cannot be read ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(path, f"not a DCP metadata file (holds {type(metadata).__name__})")
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        fqn = getattr(index, "fqn", index)
        if not (
            isinstance(name, str)
            and name not in ("", ".", "..")
            and Path(name).name == name
            and _is_count(offset)
            and _is_count(length)
        ):
            raise CheckpointError(
                path,
                f"bad storage entry for {fqn!r}: data file {show(name)} at offset "
                f"{show(offset)}, length {show(length)} (a file of the checkpoint folder expected)",
            )
        if getattr(info, "transform_descriptors", None):  # recaccel writes no compressed/transformed items
            what = f"storage entry for {fqn!r} asks for stream transforms {show(info.transform_descriptors)}"
            raise CheckpointError(path, what)
    return metadata


def _dcp_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    return FileSystemReader, DefaultLoadPlanner


def safe_dcp_reader(folder: Path) -> Any:
    """A ``FileSystemReader`` of ``folder`` that serves its ``.metadata`` read through
    :func:`read_dcp_metadata`, read now: a bad file fails here in one line (inside
    ``dcp.load`` it would be logged with tracebacks, then wrapped).

    Raises:
        CheckpointError: see :func:`read_dcp_metadata`.
    """
    reader_type, _ = _dcp_classes()
    metadata = read_dcp_metadata(folder / ".metadata")

    class SafeDCPReader(reader_type):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeDCPReader(folder)


def safe_dcp_planner(folder: Path) -> Any:
    """DCP's default load planner, but byte entries are unpickled with ``weights_only=True``
    (DCP's own planner unpickles them unrestricted)."""
    _, planner_type = _dcp_classes()

    class SafeDCPPlanner(planner_type):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            entry = read_item.dest_index.fqn
            obj = read_payload(value, f"{folder} (entry {entry!r})")
            # Only tensors, numbers, strings and containers remain: re-serialized, the
            # parent's unrestricted load of them runs nothing.
            clean = io.BytesIO()
            torch.save(obj, clean)
            clean.seek(0)
            super().load_bytes(read_item, clean)

    return SafeDCPPlanner()


def dcp_failure(folder: Path, error: BaseException) -> RecaccelError:
    """One line for an error of ``torch.distributed.checkpoint.load``: a RecaccelError
    raised inside it as is, else the first rank's first line."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        error = first[0] if isinstance(first, tuple) else first
    if isinstance(error, RecaccelError):
        return error
    if isinstance(error, pickle.UnpicklingError):  # a tensor item, which DCP loads weights_only
        return CheckpointError(folder, f"not a recaccel checkpoint ({refusal(error)})")
    return CheckpointError(folder, f"does not fit this run ({type(error).__name__}: {first_line(error)})")


# ---------------------------------------------------------------- durability


def fsync_path(path: Path) -> None:
    """Flushes a file's or a directory's entries to stable storage (directories: POSIX only)."""
    if os.name == "nt" and Path(path).is_dir():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsyncs every file under ``folder``, then each directory, innermost first."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


# ----------------------------------------------------------------- integrity

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def read_digests(sidecar: Path, path: str | os.PathLike) -> set[str] | None:
    """The SHA-256s a digest file records (``<hex>  <name>`` lines, as ``sha256sum``
    writes them); None when there is no such file.

    Raises:
        CheckpointError: naming ``path``, the digest file is unreadable or malformed.
    """
    try:
        text = sidecar.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(
            path, f"its digest file {sidecar.name} cannot be read ({first_line(e)})"
        ) from None
    found = {line.split(maxsplit=1)[0] if line.strip() else "" for line in text.splitlines()}
    if not found or not all(_HEX64.match(d) for d in found):
        raise CheckpointError(path, f"its digest file {sidecar.name} is not '<sha256 hex>  <name>' lines")
    return found


def write_digests(path: Path, digests: list[str]) -> Path:
    """Records ``digests`` as the SHA-256s ``path`` may have, in its digest file, atomically
    and durably (the directory entry too, so a checkpoint renamed after it has it).

    Returns:
        The digest file.
    """
    sidecar = digest_file(path)
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.writelines(f"{d}  {path.name}\n" for d in digests)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, sidecar)
    fsync_path(sidecar.parent)
    return sidecar


def verify_file(file: Path, path: str | os.PathLike | None = None) -> bool:
    """Checks a checkpoint file's bytes before they are read: against the SHA-256s of its
    digest file, or (a file written before recaccel recorded them, or copied without it)
    its zip container's CRC-32s.

    Args:
        file: the checkpoint file.
        path: what errors name (default ``file``).

    Returns:
        Whether a digest file vouched for it (False: its zip CRC-32s only).

    Raises:
        CheckpointError: ``checkpoint <path>: SHA-256 checksum mismatch ...`` or
            ``... zip CRC-32 checksum mismatch ...``.
    """
    path = file if path is None else path
    recorded = read_digests(digest_file(file), path)
    if recorded is None:
        check_zip_crcs(file, path)
        return False
    try:
        actual = file_sha256(file)
    except OSError as e:
        raise CheckpointError(path, f"cannot be read ({first_line(e)})") from None
    if actual not in recorded:
        raise CheckpointError(
            path,
            f"SHA-256 checksum mismatch: its bytes changed since {digest_file(file).name} was written "
            f"(corrupted on disk or edited; delete {digest_file(file).name} to check only its zip CRC-32s)",
        )
    return True


def check_zip_crcs(file: Path, path: str | os.PathLike) -> None:
    """Reads every member of a checkpoint's zip container, checking its CRC-32. A file
    that is no zip (torch's legacy format, a truncated or foreign file) is left to
    ``torch.load``, which names what it is.

    Raises:
        CheckpointError: a member whose bytes do not match its CRC-32, or a damaged container.
    """
    if not zipfile.is_zipfile(file):
        return
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:
        raise CheckpointError(
            path, f"zip CRC-32 checksum mismatch or damaged container ({first_line(e)})"
        ) from None
    if bad is not None:
        raise CheckpointError(path, f"zip CRC-32 checksum mismatch in member {bad!r}")


def folder_digests(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """The SHA-256 of every file directly in ``folder`` (but ``skip``), by name."""
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip}


def record_digests(path: Path) -> None:
    """Records the SHA-256s of a checkpoint as it is now: a ``step-*.pt`` file's digest
    file, or a ``step-*.dcp`` folder's ``sha256`` entry of ``recaccel.json``. For a
    checkpoint changed on purpose, which its old digests would refuse.

    Raises:
        CheckpointError: a folder whose ``recaccel.json`` is unreadable or not an object.
    """
    path = Path(path)
    if not path.is_dir():
        write_digests(path, [file_sha256(path)])
        return
    where = path / INFO_FILE
    try:
        info = json.loads(where.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(where, f"cannot be read ({first_line(e)})") from None
    if not isinstance(info, dict):
        raise CheckpointError(where, f"must hold a JSON object, got {show(info)}")
    info["sha256"] = folder_digests(path, skip=(INFO_FILE,))
    tmp = where.with_name(where.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, where)


def check_manifest(path: Path, manifest: Any, where: Path) -> dict[str, str]:
    """A folder's manifest (``{file name: sha256 hex}``) checked to list plain files of it.

    Args:
        path: the checkpoint folder.
        manifest: the manifest as read.
        where: the file holding it (named by the error).

    Raises:
        CheckpointError: not an object of file names to 64 hex digits.
    """
    if not isinstance(manifest, dict) or not manifest:
        raise CheckpointError(where, f"'sha256' must map the folder's files to digests, got {show(manifest)}")
    for name, digest in manifest.items():
        if not (isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name):
            raise CheckpointError(where, f"'sha256' names {show(name)}, not a file of {path.name}")
        if not (isinstance(digest, str) and _HEX64.match(digest)):
            raise CheckpointError(where, f"'sha256' of {name!r} is {show(digest)}, not 64 hex digits")
    return manifest


def verify_digests(path: Path, manifest: dict[str, str], names: list[str]) -> CheckpointError | None:
    """Checks the files ``names`` of the folder ``path`` against ``manifest``
    (:func:`check_manifest`'d); returns the first failure, or None.

    Returned, not raised, so that ranks which split a folder's files between them can
    share their outcome before any raises.
    """
    for name in names:
        try:
            actual = file_sha256(path / name)
        except FileNotFoundError:
            return CheckpointError(path, f"{name} is missing (listed in its manifest)")
        except OSError as e:
            return CheckpointError(path, f"{name} cannot be read ({first_line(e)})")
        if actual != manifest[name]:
            what = f"SHA-256 checksum mismatch in {name}: its bytes changed since the checkpoint was written"
            return CheckpointError(path, what)
    return None
