"""Writing checkpoints durably and checking their bytes.

- :func:`verify_file` / :func:`verify_digests` check a checkpoint's bytes against the
  SHA-256s recorded when it was written (a file without one: its zip CRC-32s), so a
  bit flip on disk is refused instead of loaded as changed weights;
- :func:`fsync_path` / :func:`fsync_tree` make a written checkpoint durable before it is
  renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any

from recaccel.train.checkpoint.errors import CheckpointError, first_line, show
from recaccel.train.checkpoint.paths import INFO_FILE, digest_file


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
