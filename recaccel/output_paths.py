"""Where a command writes: checked before any work, written atomically.

Every command that writes a file names it with a flag (``--out``, ``--predictions``,
``OUT``, ``--write-schema``, a converter's ``OUT_DIR``). :func:`check_output` refuses,
in one line naming the flag and the path:

- an output that is something the command reads (the data, the checkpoint, the run's
  own config.toml, log.jsonl, metrics.json, checkpoints/), or lies inside a folder it
  reads, even with ``--force``: replacing it would destroy the input mid-read;
- an output that exists, unless ``--force``.

:func:`check_output_dir` does the same for a converter's dataset folder, whose outputs
are the split folders and report file it writes there. :func:`write_atomic` writes to a
temporary file beside the destination and renames it over, so an interrupted write
leaves the old file (or none), never half of one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from recaccel.errors import RecaccelError


class OutputError(RecaccelError):
    """An output path that would replace an existing file or an input of the command."""


@dataclass(frozen=True)
class Read:
    """A path a command reads, which none of its outputs may replace.

    Attributes:
        path: a file or a folder.
        what: how a message names it, e.g. ``"the data this command reads"``.
        whole: for a folder, whether every file inside it counts as read (a Parquet
            dataset, a checkpoint folder); False when only named files in it are read, so
            outputs beside them are fine.
    """

    path: Path
    what: str
    whole: bool = True


def run_reads(run_dir: str | Path, run_files: Iterable[str]) -> list[Read]:
    """A run directory's own files and folders (``RUN_FILES`` of the run log) as reads."""
    return [Read(Path(run_dir) / name, f"the run's own {name}") for name in run_files]


def check_output(
    path: str | Path,
    *,
    flag: str,
    force: bool,
    reads: Sequence[Read] = (),
    force_flag: str = "--force",
) -> Path:
    """Refuses an output file that is an input (always) or exists (unless ``force``).

    Args:
        path: the file the command will write.
        flag: how the user named it (``--out``, ``OUT``...), for the message.
        force: the user asked to replace an existing file.
        reads: what the command reads.
        force_flag: the option that sets ``force``, for the message.

    Returns:
        ``path`` as a Path.

    Raises:
        OutputError: one line naming ``flag`` and ``path``.
    """
    out = Path(path)
    clash = _clash(out, reads)
    if clash:
        raise OutputError(f"{flag} {out} {clash}; write it elsewhere")
    if out.is_dir():
        raise OutputError(f"{flag} {out} is a directory; name a file")
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise OutputError(f"{flag} {out}: {blocked} is a file, not a folder")
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputError(f"{flag} {out} exists (pass {force_flag} to replace it)")
    return out


def check_output_dir(
    out_dir: str | Path,
    targets: Iterable[str],
    *,
    flag: str,
    force: bool,
    reads: Sequence[Read] = (),
    force_flag: str = "--overwrite",
) -> Path:
    """Refuses a dataset folder whose outputs would replace an input (always) or existing
    files (unless ``force``).

    Args:
        out_dir: the folder a converter writes into.
        targets: what it writes there (split folders, the report file), relative to it;
            ``"."`` when it writes its files into ``out_dir`` itself.
        flag: how the user named the folder, for the message.
        force: the user asked to replace what is there.
        reads: what the converter reads.
        force_flag: the option that sets ``force``, for the message.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        OutputError: one line naming ``flag`` and the path.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out} is a file; name a folder")
    for target in (out / t for t in targets):
        clash = _clash(target, reads) or _holds_a_read(target, reads)
        if clash:
            raise OutputError(f"{flag} {out}: {target} {clash}; write it elsewhere")
        if _holds_something(target) and not force:
            raise OutputError(f"{flag} {out} already holds {target} (pass {force_flag} to replace it)")
    return out


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Calls ``write(tmp)`` on a temporary file beside ``path``, then renames it to ``path``.

    The folder is created. If ``write`` fails (disk full, interrupted), the temporary
    file is removed and ``path`` keeps its old content (or stays absent); an OSError
    about the temporary file is raised again naming ``path``.

    Returns:
        ``path`` as a Path.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp{out.suffix}")  # the suffix kept: writers check it
    try:
        write(tmp)
        os.replace(tmp, out)
    except OSError as e:
        _discard(tmp)
        if e.errno is None or (e.filename is not None and Path(os.fsdecode(e.filename)) != tmp):
            raise
        raise OSError(e.errno, e.strerror, str(out)) from e  # the user's path, not the temporary one
    except BaseException:
        _discard(tmp)
        raise
    return out


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) written to ``path`` by :func:`write_atomic`."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _discard(tmp: Path) -> None:
    """Removes a temporary file if it is there (never failing over it: the write's error
    is the one to report)."""
    with contextlib.suppress(OSError):
        tmp.unlink()


def _clash(out: Path, reads: Sequence[Read]) -> str:
    """How ``out`` collides with a read (``"is the data ..."``), or ``""``."""
    target = out.resolve()
    for read in reads:
        source = read.path.resolve()
        if target == source or _same_file(out, read.path):
            return f"is {read.what}"
        if read.whole and read.path.is_dir() and target.is_relative_to(source):
            return f"is inside {read.what}"
    return ""


def _holds_a_read(folder: Path, reads: Sequence[Read]) -> str:
    """Whether writing the folder ``folder`` (deleting its old parts) could remove a read."""
    inside = folder.resolve()
    for read in reads:
        if read.path.resolve().is_relative_to(inside):
            return f"holds {read.what}"
    return ""


def _same_file(a: Path, b: Path) -> bool:
    """Hard links (and other aliases resolve() does not see) of one file."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _holds_something(target: Path) -> bool:
    """A file, or a folder with anything in it."""
    if target.is_dir():
        return any(target.iterdir())
    return target.exists() or target.is_symlink()
