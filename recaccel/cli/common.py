"""What every console entry point shares: one-line errors, logging, config arguments,
the metrics summary."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recaccel.errors import RecaccelError
from recaccel.train.run.console import is_count


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Runs a command's ``body``: bad input, an OS failure or exhausted memory is one
    line on stderr (``prog: error: ...``) and exit status 2, never a traceback."""
    try:
        return body()
    except RecaccelError as e:
        return _fail(prog, e)
    except OSError as e:
        return _fail(prog, RecaccelError(os_error_line(e)))
    except MemoryError as e:
        return _fail(prog, RecaccelError(memory_error_line(e)))
    except KeyboardInterrupt as e:
        return _interrupted(prog, e)
    except Exception as e:
        if not _is_torch_out_of_memory(e):
            raise
        return _fail(prog, RecaccelError(memory_error_line(e)))


def _interrupted(prog: str, interrupt: KeyboardInterrupt) -> int:
    """Exit status 130 (143 for a run that SIGTERM stopped), with one line: how the run
    stopped and where it resumes (under torchrun, from rank 0 only)."""
    from recaccel.train.loop.preemption import Preempted

    if not isinstance(interrupt, Preempted):
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {interrupt.message}", file=sys.stderr)
    return interrupt.exit_status


def _fail(prog: str, error: RecaccelError) -> int:
    if not handed_to_launcher(error):
        print(f"{prog}: error: {_one_line(str(error))}", file=sys.stderr)
    return 2


def os_error_line(error: OSError) -> str:
    """One line for an OS failure: what happened and to which path (for a full disk, the
    bytes left on its filesystem)."""
    path = error.filename
    where = f"{path}: " if path is not None else ""
    if path is not None and error.filename2 is not None:
        where = f"{path} -> {error.filename2}: "
    code = error.errno
    if code == errno.ENOSPC:
        free = _free_bytes(path)
        left = f"; {free} bytes free on its filesystem" if free is not None else ""
        return f"{where}disk full (no space left on device){left}"
    if code == errno.EROFS:
        return f"{where}read-only filesystem"
    if code in (errno.EACCES, errno.EPERM):
        return f"{where}permission denied"
    if code == errno.ENAMETOOLONG:
        return f"{where}file name too long"
    if code == errno.EDQUOT:
        return f"{where}disk quota exceeded"
    if error.strerror:
        return f"{where}{error.strerror}"
    return str(error) or type(error).__name__  # e.g. pyarrow's OSError: its text has the path


def memory_error_line(error: BaseException) -> str:
    """One line for exhausted host (MemoryError, torch's CPU allocator) or GPU (torch's
    OutOfMemoryError) memory."""
    what = _one_line(str(error))
    tried = re.search(r"tried to allocate [^.]*(?:\.\d+ ?\w+)?", what, re.IGNORECASE)
    if tried:  # torch's message: keep the allocation, drop the advice and allocator detail
        what = tried.group(0)
    detail = f" ({what})" if what else ""
    return (
        f"out of memory{detail}; reduce data.batch_size (or data.eval_batch_size, "
        "data.shuffle_buffer_rows), the embedding tables (model.embedding_dim, cardinalities) "
        "or the MLPs (model.bottom_mlp, model.top_mlp)"
    )


# torch's CPU allocator reports a failed allocation as a RuntimeError with this text.
_CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"


def _is_torch_out_of_memory(error: Exception) -> bool:
    torch = sys.modules.get("torch")  # never import torch just to ask
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(error, oom):
        return True
    return torch is not None and isinstance(error, RuntimeError) and _CPU_ALLOCATOR_FAILED in str(error)


def _free_bytes(path: str | bytes | None) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing folder)."""
    if path is None:
        return None
    folder = Path(os.fsdecode(path)).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def handed_to_launcher(error: BaseException) -> bool:
    """A rank under torchrun's agent hands its error line to the launcher, which shows it once."""
    from recaccel.train.distributed.launch import report_rank_error

    return report_rank_error(error)


def setup_logging(verbose: bool, *, quiet: bool = False) -> None:
    """Logs at INFO with ``verbose`` (WARNING otherwise) and shows the run's console lines
    (:mod:`recaccel.train.run.console`): none when ``quiet``, their verbose ones too with
    ``verbose``."""
    from recaccel.train.run.console import show_console

    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    show_console(logging.CRITICAL + 1 if quiet else logging.DEBUG if verbose else logging.INFO)


def add_config_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--config",
        action="append",
        required=required,
        metavar="FILE",
        help="TOML config file (see configs/; repeatable: merged left to right); without it, built-in defaults",
    )
    add_set_arg(parser, "override a config value (repeatable), e.g. --set train.steps=100")


def add_set_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable), collected into ``args.overrides``."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=help_text,
    )


# The metrics of each meta evaluation state that the console shows.
_STATE_KEYS = ("mae", "rmse", "auc", "gauc", "ne", "calibration", "ndcg@1", "ndcg@3")
_STATE_KEYS += ("mae_no_adapt", "ndcg@3_no_adapt")


def print_metrics(metrics: dict[str, Any], out_dir: Path, data_dir: Path | None = None) -> None:
    shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) or v is None}
    planted = data_dir / "synth.json" if data_dir is not None else None
    if planted is not None and planted.is_file():
        # Synthetic data: show how far the model is from the planted (Bayes-optimal) one.
        shown["bayes_auc (planted model)"] = json.loads(planted.read_text())["report"]["bayes_auc"]
    for state, values in metrics.get("states", {}).items():
        for key in _STATE_KEYS:
            if key in values:
                shown[f"{state}.{key}"] = values[key]
    width = max(len(k) for k in shown)
    for key in sorted(shown):
        print(f"{key:<{width}}  {format_metric(key, shown[key])}")
    print(f"metrics written to {out_dir / 'metrics.json'}")


def format_metric(key: str, value: Any) -> str:
    """One metric as the console shows it: counts as integers, other floats with five
    decimals, NaN as ``nan``, anything else as ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (is_count(key) and float(value).is_integer()):
        return str(int(value))
    return f"{value:.5f}"  # NaN shows as "nan"
