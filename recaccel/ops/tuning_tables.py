"""Per-device kernel launch configurations: generated table modules, read at launch.

A tuning run on a GPU measures the candidate configurations of a kernel family and
writes the winners into a generated Python module (``TABLE = {device name: {shape key:
{field: int}}}``), so that the table ships with the package without package-data
settings. A kernel looks its shape key up for the device it runs on; a device or shape
the table does not hold gets ``None``, and the kernel keeps its own heuristic (the sound
choice for a device nobody has tuned on). Used by the embedding kernels
(:mod:`recaccel.ops.embedding.triton.tuning`) and the dot interaction
(:mod:`recaccel.ops.interaction.tuning`).
"""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

import torch

from recaccel.errors import ConfigError

Table = dict[str, dict[str, dict[str, int]]]


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float32`` or ``"float32"`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=16)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str) -> str:
    """A table's device key: the CUDA device's name, ``"cpu"`` for anything else."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def lookup_in(table: Table, device: str, key: str) -> dict[str, int] | None:
    """``key``'s tuned fields for the device named ``device`` (:func:`device_name`) in ``table``, or None."""
    return table.get(device, {}).get(key)


def check_entry(entry: dict, required: tuple[str, ...], optional: tuple[str, ...] = (), *, name: str) -> None:
    """Refuses a hand-edited entry: a required field missing, an unknown one, or a value
    that is not an int (bools too).

    Args:
        entry: The entry as the table holds it.
        required: Fields it must have. optional: Fields it may have.
        name: What the one-line error calls the entry (table and key).

    Raises:
        ConfigError: one line naming ``name``, the entry and the wrong fields.
    """
    allowed = set(required) | set(optional)
    wrong = [f for f in required if f not in entry] + sorted(set(entry) - allowed)
    wrong += [f for f in entry if f in allowed and type(entry[f]) is not int]
    if wrong:
        raise ConfigError(
            f"{name} = {entry!r}: {', '.join(wrong)}: the entry holds integer {', '.join(sorted(allowed))}"
        )


def read_table(path: str | Path) -> Table:
    """The table a generated module at ``path`` holds ({} when there is no file)."""
    path = Path(path)
    if not path.exists():
        return {}
    text = path.read_text()
    # A literal, not JSON: the module may have been through ruff format (trailing commas).
    return ast.literal_eval(text[text.index("TABLE = ") + len("TABLE = ") :])


def write_table(path: str | Path, device: str, entries: dict[str, dict[str, int]], header: str) -> Path:
    """Merges ``device``'s winners into the generated module at ``path`` (other devices
    and other keys kept), under the module docstring ``header``.

    Each entry is written on one line (the layout ``ruff format`` gives a short dict), as
    JSON, which is also a valid Python literal of strings and ints.
    """
    path = Path(path)
    table = read_table(path)
    table[device] = {**table.get(device, {}), **entries}
    lines = [f'"""{header}"""', "", "TABLE = {"]
    for name in sorted(table):
        if not table[name]:
            lines.append(f"    {json.dumps(name)}: {{}},")
            continue
        lines.append(f"    {json.dumps(name)}: {{")
        for key in sorted(table[name]):
            lines.append(f"        {json.dumps(key)}: {json.dumps(table[name][key], sort_keys=True)},")
        lines.append("    },")
    lines.append("}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
