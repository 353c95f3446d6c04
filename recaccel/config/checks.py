"""How a config field is checked: the annotation rules (:class:`Range`, :class:`Pattern`),
:func:`check_value`, and :class:`Section`, the base whose ``__post_init__`` checks every
field of a config section (see :mod:`recaccel.config` for the sections).

Every problem is one :class:`ConfigError` line naming the key as ``section.key=value``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from recaccel.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The allowed interval of a numeric field (unset bounds are open-ended).

    Attributes:
        ge, gt: the value must be >= ``ge`` / > ``gt``.
        le, lt: the value must be <= ``le`` / < ``lt``.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __contains__(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    @property
    def requirement(self) -> str:
        """What a value must be, for messages: ``must be >= 0 and < 1``."""
        bounds = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        return "must be " + " and ".join(f"{op} {_bound(b)}" for op, b in bounds if b is not None)


def _bound(value: float) -> str:
    """An interval bound as a user types it: integers in full (4294967295, not 4.29497e+09)."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**63 else f"{value:g}"


@dataclass(frozen=True)
class Pattern:
    """The form of a string field: ``regex`` must match the whole value.

    Attributes:
        regex: a regular expression (``re.fullmatch``).
        requirement: what a value must be, for messages: ``must look like name=path``.
    """

    regex: str
    requirement: str

    def __contains__(self, value: str) -> bool:
        return re.fullmatch(self.regex, value) is not None


class Section:
    """Base of the config sections: ``__post_init__`` checks every field against its
    annotation (type, choices, range, form) and converts ints given for floats.

    Attributes:
        SECTION: the section's name in a config file (``[data]``).
    """

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = field_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            key = f"{self.SECTION}.{f.name}"
            setattr(self, f.name, check_value(key, getattr(self, f.name), hints[f.name]))
        self.check_consistency()

    def check_consistency(self) -> None:
        """Checks that span several fields of the section (after each field's own)."""


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config dataclass, with their ``Annotated`` extras."""
    return typing.get_type_hints(cls, include_extras=True)


def check_value(key: str, value: Any, hint: Any) -> Any:
    """Checks ``value`` against a field's annotation (type, choices, range, form).

    Args:
        key: the field's ``section.key`` (``[i]`` appended for list items), for messages.
        value: the value given.
        hint: the field's resolved annotation.

    Returns:
        The value; an int given for a float field becomes a float.

    Raises:
        ConfigError: one line naming ``key=value`` and what it must be.
    """
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *rules = typing.get_args(hint)
        checked = check_value(key, value, base)
        for rule in rules:
            if checked not in rule:
                raise _bad(key, value, rule.requirement)
        return checked
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed or not isinstance(value, str):
            hint_text = suggest(value, allowed) if isinstance(value, str) else ""
            raise _bad(key, value, f"must be one of {', '.join(allowed)}{hint_text}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        errors = []
        for arg in args:
            try:
                return check_value(key, value, arg)
            except ConfigError as e:
                errors.append((arg, e))
        for arg, e in errors:  # a word is refused by the alternative of words, which lists them
            if isinstance(value, str) and typing.get_origin(arg) is Literal:
                raise e
        raise errors[0][1]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise _bad(key, value, "must be a table")
        return {k: check_value(f"{key}.{k}", v, item) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Section):
        return _check_table(key, value, hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise _bad(key, value, "must be a list")
        return [check_value(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    return _check_scalar(key, value, hint)


def _check_table(key: str, value: Any, cls: type[Section]) -> Section:
    """A nested table (``[data.schema]``): a ``cls`` as it is, or built from a dict whose
    keys and values are checked under ``key``."""
    if isinstance(value, cls):
        value.__post_init__()
        return value
    if not isinstance(value, dict):
        raise _bad(key, value, "must be a table")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in value:
        if k not in names:
            raise ConfigError(f"unknown config key {key}.{k}{suggest(k, names, key + '.')}")
    hints = field_hints(cls)
    return cls(**{k: check_value(f"{key}.{k}", v, hints[k]) for k, v in value.items()})


def _check_scalar(key: str, value: Any, hint: Any) -> Any:
    if hint is Any:  # passed on as given (model.init_args: the model's own arguments)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _bad(key, value, "must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(key, value, "must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(key, value, "must be a number")
        if not math.isfinite(value):
            raise _bad(key, value, "must be a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _bad(key, value, "must be a string")
        return value
    raise ConfigError(f"config key {key} has unsupported type {hint}")


def _bad(key: str, value: Any, requirement: str) -> ConfigError:
    return ConfigError(f"config key {key}={show_value(value)} {requirement}")


def show_value(value: Any) -> str:
    """A value as one short line: TOML-like, strings bare when they are plain words."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value if re.fullmatch(r"[\w.:/+@=-]+", value) else json.dumps(value)
    elif isinstance(value, list):
        text = "[" + ", ".join(show_value(v) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k} = {show_value(v)}" for k, v in value.items()) + "}"
    else:
        text = " ".join(repr(value).split())
    return text if len(text) <= 120 else text[:117] + "..."


def suggest(name: str, valid: Any, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else f" (valid: {', '.join(sorted(valid))})"


# Shorthands for the config fields' annotations.
Count = Annotated[int, Range(ge=1)]  # a size or count that must be at least 1
NonNegative = Annotated[int, Range(ge=0)]  # 0 has a documented meaning at each use
Seed = Annotated[int, Range(ge=0)]  # reaches numpy's SeedSequence / default_rng: any size
GlobalSeed = Annotated[int, Range(ge=0, le=2**32 - 1)]  # reaches np.random.seed: 32 bits
Rate = Annotated[float, Range(gt=0)]  # a learning rate, a timeout
NonNegativeFloat = Annotated[float, Range(ge=0)]
PathText = Annotated[str, Pattern(r".+", "must be a non-empty path")]
NamedPath = Annotated[str, Pattern(r"[^=]+=.+", "must look like name=path")]
Name = Annotated[str, Pattern(r".+", "must be a non-empty name")]
Fraction = Annotated[float, Range(gt=0, le=1)]
TablePlacementText = Annotated[
    str, Pattern(r"[^=]+=(device|host)", "must look like table=device or table=host")
]
