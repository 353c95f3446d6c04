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
