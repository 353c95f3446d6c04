"""Every recaccel command's --help, each subcommand's, and every config key's description
read as a user's text: no code names (backticks, Sphinx roles, "see SomeClass"), no
doubled words, and nothing left undescribed."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

import recaccel.cli as cli
from recaccel.config import field_hints, section_types
from recaccel.config.help import _table_class, config_reference, field_docs

COMMANDS = ("train", "data", "bench", "eval", "export", "plot", "monitor")
# What leaks code into help text, and the doubled word of a slip ("every every steps"); a
# flag followed by its own metavar (--seed SEED) is not a doubled word.
LEAKS = {
    "a backtick": r"`",
    "a Sphinx role": r":(mod|class|func|meth|attr|data):",
    "a class name": r"\bsee [A-Z][a-z]+[A-Z]\w*",
    "a doubled word": r"(?<![-\w])([A-Za-z]{2,})\s+\1\b",
}


class _Parsed(Exception):
    """Raised in place of parsing: the parser a command built is what the test wants."""


def _parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    built = []

    def capture(self, *args, **kwargs):
        built.append(self)
        raise _Parsed

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        with pytest.raises(_Parsed):
            main([])
    return built[0]


def _with_subcommands(name: str, parser: argparse.ArgumentParser):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _with_subcommands(f"{name} {sub}", subparser)


def _every_parser(monkeypatch) -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for command in COMMANDS:
        parser = _parser_of(getattr(cli, f"{command}_main"), monkeypatch)
        found += _with_subcommands(f"recaccel-{command}", parser)
    return found


def _leaks(text: str) -> list[str]:
    return [
        f"{what}: ...{text[max(0, m.start() - 40) : m.end() + 20]!r}..."
        for what, pattern in LEAKS.items()
        for m in re.finditer(pattern, text)
    ]


def _undescribed(parser: argparse.ArgumentParser) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            missing += [c.dest for c in action._choices_actions if not (c.help or "").strip()]
        elif action.help != argparse.SUPPRESS and not (action.help or "").strip():
            missing.append("/".join(action.option_strings) or action.dest)
    return missing


def test_every_command_and_subcommand_help_reads_without_code_names_or_doubled_words(monkeypatch):
    parsers = _every_parser(monkeypatch)
    names = [name for name, _ in parsers]
    assert "recaccel-data synth" in names and "recaccel-bench train" in names  # subcommands walked
    problems = {name: _leaks(parser.format_help()) for name, parser in parsers}
    assert not {k: v for k, v in problems.items() if v}


def test_every_option_and_subcommand_has_a_description(monkeypatch):
    problems = {name: _undescribed(parser) for name, parser in _every_parser(monkeypatch)}
    assert not {k: v for k, v in problems.items() if v}


def _tables(cls: type, title: str):
    yield title, cls
    for f in dataclasses.fields(cls):
        nested = _table_class(field_hints(cls)[f.name])
        if nested is not None:
            yield from _tables(nested[0], f"{title}.{f.name}{nested[1]}")


def test_every_config_key_has_a_description():
    missing = [
        f"{title}.{f.name}"
        for name, cls in section_types().items()
        for title, table in _tables(cls, name)
        for f in dataclasses.fields(table)
        if not field_docs(table).get(f.name, "").strip()
    ]
    assert not missing


def test_the_config_reference_reads_without_code_names_or_doubled_words():
    assert not _leaks(config_reference())


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("data.batch_size", "training rows per step"),
        ("data.shuffle", "random order"),
        ("data.drop_last", "fewer than batch_size rows"),
        ("train.deterministic", "deterministic kernels"),
        ("train.pipeline", "side stream"),
        ("train.precision", "TF32 tensor cores"),
    ],
)
def test_the_keys_users_asked_about_are_described(key, words):
    section, name = key.split(".")
    assert words in field_docs(section_types()[section])[name]


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("trains every every steps", "a doubled word"),
        ("the value (see PipelineMode)", "a class name"),
        ("read by :mod:`recaccel.io`", "a Sphinx role"),
        ("run `epochs`", "a backtick"),
    ],
)
def test_the_scan_catches_each_leak(text, what):
    assert any(found.startswith(what) for found in _leaks(text))
    assert not _leaks("--seed SEED  seeds the data")
