"""What the console shows of a training run.

One line per evaluation (periodic and final), per monitor flag, straggler decision and
elastic restart; with ``-v`` also per-phase timing and data counters at each log step.
Every line goes to the ``recaccel.console`` logger: from Python nothing below WARNING is
shown unless the caller configures logging; the command line shows them through
:func:`show_console`, above the progress bar, at the level ``-q`` / ``-v`` pick.

Numbers: integers (and integer-valued counts) without decimals, other floats at five
significant digits.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

CONSOLE_LOGGER = "recaccel.console"
console = logging.getLogger(CONSOLE_LOGGER)

# A metric is a count when a word of its name is one of these and none is a rate word.
_COUNT_WORDS = frozenset(
    {"rows", "tasks", "steps", "step", "epochs", "epoch", "hits", "misses", "requests", "bytes"}
    | {"evicted", "fetched", "restarts", "flags", "count", "samples", "batches", "ids"}
)
_RATE_WORDS = frozenset({"per", "rate", "fraction", "ratio", "mean", "avg", "s"})


def is_count(key: str) -> bool:
    """Whether the metric named ``key`` (``state.name`` allowed) counts things, so that an
    integer value of it is shown without decimals (``tasks 189``, not ``189.00000``)."""
    words = set(re.split(r"[_.@\s]+", key.rsplit(".", 1)[-1].lower()))
    return bool(words & _COUNT_WORDS) and not words & _RATE_WORDS


def format_number(key: str, value: Any) -> str:
    """One value as the console shows it: integers and integer-valued counts without
    decimals, other floats at five significant digits (no exponent below 1e5), NaN as
    ``nan``, anything else as ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (is_count(key) and float(value).is_integer()):
        return str(int(value))
    if math.isfinite(value) and abs(value) >= 1e5:
        return f"{value:.0f}"
    return f"{value:.5g}"


def metrics_text(metrics: Mapping[str, Any]) -> str:
    """The scalar entries of ``metrics`` as ``name value`` pairs, in their order (nested
    tables and lists are left to metrics.json)."""
    return "  ".join(
        f"{key} {format_number(key, value)}"
        for key, value in metrics.items()
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
    )


def eval_line(step: int, metrics: Mapping[str, Any], *, final: bool = False) -> str:
    """The line of one evaluation: ``eval step 20: auc 0.71234  logloss 0.52``."""
    what = "final eval" if final else "eval"
    return f"{what} step {step}: {metrics_text(metrics)}"


def show_eval(step: int, metrics: Mapping[str, Any], *, final: bool = False) -> None:
    console.info("%s", eval_line(step, metrics, final=final))


def show_event(text: str, *args: Any, warning: bool = False) -> None:
    """A line for a monitor flag, straggler decision or restart (``warning``: shown by
    default from Python too)."""
    console.log(logging.WARNING if warning else logging.INFO, text, *args)


# The final line's metrics, in this order, when present.
_FINAL_KEYS = ("steps", "auc", "gauc", "logloss", "ne", "calibration", "mae", "rmse", "ndcg@3")
_FINAL_KEYS += ("train_loss", "samples_per_s", "restarts", "flags")


def final_line(metrics: Mapping[str, Any], metrics_path: str) -> str:
    """One line summing up a finished run (what ``-q`` prints)."""
    shown = {k: metrics[k] for k in _FINAL_KEYS if k in metrics}
    return f"{metrics_text(shown)}  ({metrics_path})"


class PhaseTimer:
    """Per-phase timing between log steps, for ``-v``: seconds per step spent waiting
    for data and the rest of the step, and the data counters so far."""

    def __init__(self) -> None:
        self._at = (0, 0.0, 0.0)  # (step, training seconds, data wait seconds) at the last line

    def start(self, step: int, seconds: float, wait: float) -> None:
        self._at = (step, seconds, wait)

    def line(self, step: int, seconds: float, wait: float, counters: Mapping[str, int]) -> str:
        """``step 50: 12.3 ms/step (data wait 1.2 ms, step 11.1 ms); rows 25600 read, ...``"""
        before, seconds_before, wait_before = self._at
        self._at = (step, seconds, wait)
        steps = max(step - before, 1)
        per_step = (seconds - seconds_before) / steps * 1e3
        waited = (wait - wait_before) / steps * 1e3
        timing = (
            f"{per_step:.3g} ms/step (data wait {waited:.3g} ms, step {max(per_step - waited, 0):.3g} ms)"
        )
        return f"step {step}: {timing}; {data_text(counters)}"

    def show(self, step: int, seconds: float, wait: float, counters: Mapping[str, int]) -> None:
        if console.isEnabledFor(logging.DEBUG):
            console.debug("%s", self.line(step, seconds, wait, counters))


def data_text(counters: Mapping[str, int]) -> str:
    """The reader's counters that say what happened to the data: rows read and skipped,
    bad ids, and for task data tasks read."""
    read = counters.get("rows_read", 0)
    skipped = counters.get("rows_skipped", 0)
    bad_ids = counters.get("rows_skipped_invalid_ids", 0) + counters.get("ids_clipped", 0)
    text = f"rows {read} read, {skipped} skipped, bad ids {bad_ids}"
    if "tasks_yielded" in counters:
        text += f", tasks {counters['tasks_yielded']}"
    return text


# ------------------------------------------------------------------- the command line


class _AboveTheBar(logging.Handler):
    """Writes each line to the current ``sys.stderr`` above any tqdm bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def show_console(level: int) -> None:
    """Shows the console lines at ``level`` and above on stderr (the command line's
    ``-q``: above CRITICAL, nothing; default INFO; ``-v`` DEBUG). Calling it again
    replaces the previous setting."""
    for handler in list(console.handlers):
        if isinstance(handler, _AboveTheBar):
            console.removeHandler(handler)
    handler = _AboveTheBar()
    handler.setFormatter(logging.Formatter("%(message)s"))
    console.addHandler(handler)
    console.setLevel(level)
    console.propagate = False  # its own format, not the root's timestamped one


# Packages whose warnings are summed up in one line unless -v.
_THIRD_PARTY = ("torchrec", "fbgemm_gpu", "torch", "pyarrow", "numpy", "triton", "tensorboard")


def _package(filename: str, module: str | None) -> str | None:
    """The third-party package a warning comes from, or None for others (recaccel's own)."""
    parts = re.split(r"[\\/]", filename)
    for name in reversed(parts[:-1]):
        if name in _THIRD_PARTY:
            return name
    top = (module or "").split(".")[0]
    return top if top in _THIRD_PARTY else None


class WarningTally:
    """Counts the third-party warnings it hid, by package (see :func:`hidden_warnings`)."""

    def __init__(self) -> None:
        self.by_package: Counter[str] = Counter()

    def summary(self) -> str | None:
        """``5 warnings from torchrec, torch hidden; -v shows them``, or None when none was hidden."""
        total = sum(self.by_package.values())
        if not total:
            return None
        names = ", ".join(name for name, _ in self.by_package.most_common())
        noun = "warning" if total == 1 else "warnings"
        return f"{total} {noun} from {names} hidden; -v shows them"


@contextmanager
def hidden_warnings(*, show_summary: bool) -> Iterator[WarningTally]:
    """Hides the warnings third-party packages (torch, torchrec, ...) raise inside it,
    counting them; on exit, with ``show_summary``, one console line says how many were
    hidden. Other warnings are shown as usual; the previous warning settings come back."""
    tally = WarningTally()
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
            package = _package(filename, getattr(message, "__module__", None))
            if package is None:
                shown(message, category, filename, lineno, file, line)
            else:
                tally.by_package[package] += 1

        warnings.showwarning = show
        try:
            yield tally
        finally:
            text = tally.summary()
            if show_summary and text is not None:
                console.warning("%s", text)
