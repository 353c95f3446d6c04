"""Building a :class:`~recaccel.config.Config`: TOML files merged, ``section.key=value``
overrides applied, every key checked; and writing one back as TOML."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recaccel.config.checks import show_value, suggest
from recaccel.config.files import merge_tables, parse_override, read_toml, resolve_paths, toml_value
from recaccel.config.rules import check_rules
from recaccel.config.sections import Config, section_types
from recaccel.errors import ConfigError


def load_config(
    path: str | Path | Sequence[str | Path] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    paths_relative_to_file: bool = True,
) -> Config:
    """Loads TOML config files, merged left to right, and applies ``section.key=value`` overrides.

    Files merge table by table and key by key (nested tables such as ``[data.schema]``
    too): a later file's value replaces an earlier one's, a list is replaced whole, keys
    it does not give are kept. Overrides apply after every file.

    Paths: a path-valued key (:func:`path_fields`: ``data.train``, ``data.test``,
    ``train.out_dir``, ``synth.out_dir``, the paths of ``meta.eval_states``...) written
    relative in a file is relative to that file's folder, and comes back absolute;
    override values and defaults are left as given (relative to the working directory).

    Args:
        path: a config file, several (merged left to right), or None (the defaults).
        overrides: ``section.key=value`` items, the value in TOML (a bare word is a string).
        paths_relative_to_file: False reads a file's paths as written, relative to the
            working directory: how a run directory's own config.toml is read (see
            :func:`recaccel.api.run_config`), since runs before this rule wrote them so.

    Raises:
        ConfigError: on a missing, unreadable or non-UTF-8 file, a TOML syntax error, a
            section that is not a table, an unknown key, a bad value or a broken rule across
            sections (:mod:`recaccel.config.rules`).
    """
    if path is None:
        files: list[Path] = []
    elif isinstance(path, (str, Path)):
        files = [Path(path)]
    else:
        files = [Path(p) for p in path]
    raw: dict[str, Any] = {}
    for file in files:
        values = _read_toml(file)
        if paths_relative_to_file:
            values = resolve_paths(values, file.parent.resolve(), section_types())
        merge_tables(raw, values)
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})[key] = value
    cfg = config_from_dict(raw)
    check_rules(cfg)  # the rules across sections: refused here, before any process starts
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Builds a :class:`Config` from nested dicts, checking every key and value.

    Raises:
        ConfigError: naming the first unknown section or key, or bad value.
    """
    _check_tables(raw)
    built = {}
    for section, values in raw.items():
        cls = section_types()[section]
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(f"unknown config key {section}.{key}{suggest(key, names, section + '.')}")
        built[section] = cls(**values)
    return Config(**built)


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: Config) -> str:
    """Serializes a resolved config as TOML (it loads back to an equal Config)."""
    lines: list[str] = []
    for section, values in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue  # TOML has no null; None fields default to None on load
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _read_toml(p: Path) -> dict[str, Any]:
    raw = read_toml(p)
    _check_tables(raw, f"config file {p}: ")
    return raw


def _check_tables(raw: dict[str, Any], where: str = "") -> None:
    """Every top-level key of a config must be a known section holding a table."""
    sections = section_types()
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(f"{where}unknown config section [{section}]{suggest(section, sections)}")
        if not isinstance(values, dict):
            raise ConfigError(
                f"{where}config section [{section}] must be a table of keys ([{section}] and the keys "
                f"below it), got {section} = {show_value(values)}"
            )
