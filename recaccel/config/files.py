"""Config files: which fields hold paths, relative paths made absolute against their
file's folder, files merged table by table, TOML read and written, ``section.key=value``
overrides parsed (used by :func:`recaccel.config.load_config` and ``config_to_toml``).
"""

from __future__ import annotations

import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from recaccel.config.checks import NamedPath, PathText, field_hints
from recaccel.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def path_fields(cls: type) -> dict[str, bool]:
    """The path-valued fields of a config section: each field annotated :data:`PathText` or
    :data:`NamedPath` (also as a list's items, or optional), mapped to whether it is a
    ``name=path`` entry."""
    found = {}
    for name, hint in field_hints(cls).items():
        kind = _path_kind(hint)
        if kind is not None:
            found[name] = kind
    return found


def _path_kind(hint: Any) -> bool | None:
    """True for a ``name=path`` annotation, False for a plain path, None for neither."""
    if hint == PathText:
        return False
    if hint == NamedPath:
        return True
    if typing.get_origin(hint) in (list, typing.Union, types.UnionType):
        kinds = [k for k in map(_path_kind, typing.get_args(hint)) if k is not None]
        return kinds[0] if kinds else None
    return None


def resolve_paths(raw: dict[str, Any], base: Path, sections: dict[str, type]) -> dict[str, Any]:
    """``raw`` (a config as nested dicts) with every relative path value made absolute
    against ``base``; values of the wrong type are left for the field checks to report.

    Args:
        raw: ``{section: {key: value}}`` as read from a file.
        base: the folder relative paths are relative to (absolute).
        sections: each section's name and dataclass (:func:`recaccel.config.section_types`).
    """
    resolved = {}
    for section, values in raw.items():
        fields = path_fields(sections[section]) if section in sections and isinstance(values, dict) else {}
        if fields:
            values = {
                key: absolute_value(value, base, fields[key]) if key in fields else value
                for key, value in values.items()
            }
        resolved[section] = values
    return resolved


def absolute_value(value: Any, base: Path, named: bool) -> Any:
    """A path field's value (a path, a ``name=path`` entry when ``named``, or a list of
    them) with each relative path made absolute against ``base``; anything else as is."""
    if isinstance(value, list):
        return [absolute_value(v, base, named) for v in value]
    if not isinstance(value, str) or not value:
        return value
    if named:
        name, sep, path = value.partition("=")
        return f"{name}={_absolute(path, base)}" if sep and path else value
    return _absolute(value, base)


def _absolute(path: str, base: Path) -> str:
    """``path`` if absolute, else ``base / path`` with ``.`` and ``..`` folded away."""
    if Path(path).is_absolute():
        return path
    return os.path.normpath(base / path)


def merge_tables(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Merges ``new`` into ``into`` key by key, tables recursively; ``new`` wins."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge_tables(into[key], value)
        else:
            into[key] = value


def read_toml(p: Path) -> dict[str, Any]:
    """A TOML file's tables (not checked against the config's sections).

    Raises:
        ConfigError: a missing, unreadable or non-UTF-8 file, a TOML syntax error.
    """
    if not p.is_file():
        raise ConfigError(f"config file {p} {'is not a file' if p.exists() else 'does not exist'}")
    try:
        # utf-8-sig: a byte order mark (Windows editors write one) is not TOML syntax.
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = e.object.count(b"\n", 0, e.start) + 1
        where = f"line {line}: byte {e.object[e.start]:#04x}"
        raise ConfigError(f"config file {p} is not UTF-8 text ({where})") from None
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p}: {' '.join(str(e).split())}") from None
    return raw


def toml_value(value: Any) -> str:
    """``value`` (bool, number, string, list, dict) written as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; TOML has no null, so None keys are left out
        items = (f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)


# C0 controls and DEL: a newline in a --set value would end the TOML value early.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def parse_override(item: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value in TOML, a bare word a string.

    Raises:
        ConfigError: no ``=``, a key that is not ``section.key``, or a control character
            (a newline, a tab...) in the item: TOML would read the value up to the newline
            and the rest as further keys, silently.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {dotted!r} must look like section.key")
    control = _CONTROL.search(item)
    if control:
        raise ConfigError(
            f"override {dotted.strip()!r}: the value holds a control character "
            f'({control.group()!r}); give one line (a TOML string escapes it, e.g. "a\\nb")'
        )
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string: model.embedding_backend=triton
    return parts[0], parts[1], value
