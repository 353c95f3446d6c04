"""Reading a ``torch.distributed.checkpoint`` folder as untrusted input.

:func:`safe_dcp_reader` / :func:`safe_dcp_planner` read the folder with its ``.metadata``
pickle restricted to DCP's own metadata classes and its byte entries restricted like
:func:`~recaccel.train.checkpoint.payload.read_payload`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch

from recaccel.errors import RecaccelError
from recaccel.train.checkpoint.errors import CheckpointError, first_line, refusal, show
from recaccel.train.checkpoint.payload import is_count, read_payload

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
            and is_count(offset)
            and is_count(length)
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
