"""The one-line errors of reading a checkpoint: :class:`CheckpointError` and the helpers
that keep torch's messages to their first useful line."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

from torch import Tensor

from recaccel.errors import RecaccelError

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


def show(value: Any) -> str:
    """A short one-line description of a checkpoint value."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} {text[:50]}..."
