"""The config reference of ``recaccel-train --help``, generated from the config dataclasses.

Every section and key with its default, type, choices and constraint, read from the
annotations (``Literal`` aliases give the choices, :class:`~recaccel.config.Range` and
:class:`~recaccel.config.Pattern` the constraints), and a line of documentation: the
field's ``metadata["doc"]`` where set, else the comment beside (or right above) the
field in the class's source, when the source is installed.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from typing import Annotated, Any, Literal

from recaccel.config.checks import NamedPath, PathText, Pattern, Range, field_hints
from recaccel.config.files import path_fields
from recaccel.config.sections import section_types

WIDTH = 100  # characters per help line
DOC_INDENT = " " * 6


def config_rules() -> str:
    """How ``--config`` files, ``--set`` overrides and relative paths combine."""
    keys = [
        f"the paths of {name}.{key}" if named else f"{name}.{key}"
        for name, cls in section_types().items()
        for key, named in path_fields(cls).items()
    ]
    text = (
        "--config files merge left to right (tables key by key, the later file wins), then --set "
        f"overrides apply. A relative path in a config file ({', '.join(keys)}) is relative to that "
        "file's folder; --set values and the defaults are relative to the working directory. A run's "
        "config.toml holds its paths absolute, so --resume works from any folder."
    )
    return textwrap.fill(text, WIDTH)


def config_reference() -> str:
    """Every config section and key, one block per section (``[data]``, ...)."""
    blocks = [_section(f"[{name}]", cls) for name, cls in section_types().items()]
    return "\n\n".join(blocks)


def _section(title: str, cls: type) -> str:
    lines = textwrap.wrap(f"{title}  {_summary(cls)}", WIDTH, subsequent_indent="  ")
    docs = field_docs(cls)
    hints = field_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        lines.append(f"  {f.name} = {_default(f)}  ({describe_type(hint)})")
        doc = docs.get(f.name)
        if doc:
            lines += textwrap.wrap(doc, WIDTH, initial_indent=DOC_INDENT, subsequent_indent=DOC_INDENT)
        table = _table_class(hint)
        if table is not None:
            nested.append(_section(f"[{title[1:-1]}.{f.name}{table[1]}]", table[0]))
    return "\n\n".join(["\n".join(lines), *nested])


def _summary(cls: type) -> str:
    """The first paragraph of the class docstring, on one line."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("\n\n")[0].replace("``", "").split())


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "unset"
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return json.dumps(value)  # numbers, strings, true/false and lists as TOML writes them


def describe_type(hint: Any) -> str:
    """A field's annotation in words: ``int >= 1``, ``one of: sum, mean``, ``list of path``."""
    if hint == PathText:
        return "path"
    if hint == NamedPath:
        return "name=path"
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *rules = typing.get_args(hint)
        return "".join(describe_type(base) + _rule(r) for r in rules)
    if origin is Literal:
        return "one of: " + ", ".join(typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        text = " or ".join(describe_type(a) for a in args)
        return text + ", or unset" if len(args) < len(typing.get_args(hint)) else text
    if origin is list:
        item = describe_type(typing.get_args(hint)[0])
        return "list, each " + item if item.startswith("one of") else "list of " + item
    if origin is dict:
        item = typing.get_args(hint)[1]
        return "tables, below" if dataclasses.is_dataclass(item) else "table of " + describe_type(item)
    if dataclasses.is_dataclass(hint):
        return "table"
    if hint is Any:
        return "any value"
    return getattr(hint, "__name__", str(hint))


def _rule(rule: Any) -> str:
    if isinstance(rule, Range):
        return " " + rule.requirement.removeprefix("must be ")
    if isinstance(rule, Pattern):
        return ", " + rule.requirement
    return str(rule)


def _table_class(hint: Any) -> tuple[type, str] | None:
    """The dataclass of a nested table field and the suffix naming its entries:
    ``(SchemaMapping, "")`` for ``[data.schema]``, ``(SparseColumn, ".NAME")`` for a
    table of tables."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            found = _table_class(arg)
            if found is not None:
                return found
        return None
    if origin is dict:
        item = typing.get_args(hint)[1]
        return (item, ".NAME") if dataclasses.is_dataclass(item) else None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, ""
    return None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation: ``metadata["doc"]``, else its source comment."""
    comments = _source_comments(cls)
    docs = {}
    for f in dataclasses.fields(cls):
        doc = f.metadata.get("doc") or comments.get(f.name)
        if doc:
            docs[f.name] = doc
    return docs


def _source_comments(cls: type) -> dict[str, str]:
    """The comments beside each annotated field of ``cls``'s source, and those on the
    lines right above it; empty when the source is not available."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    by_line: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            by_line[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(token.start[0])
    (body,) = ast.parse(source).body
    comments = {}
    for node in body.body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line in by_line and line not in code_lines:
            above.insert(0, by_line[line])
            line -= 1
        beside = [
            by_line[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in by_line
        ]
        text = " ".join(above + beside)
        if text:
            comments[node.target.id] = text
    return comments
