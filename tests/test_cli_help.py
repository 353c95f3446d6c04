"""recaccel-train's discoverability: --help lists every config key, --print-config,
--version, and a missing dataset names the recaccel-data command that makes it."""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

import recaccel
from recaccel.cli import train_main
from recaccel.config import Range, config_from_dict, field_hints, load_config, section_types
from recaccel.config.help import _table_class, config_reference, describe_type, field_docs
from recaccel.errors import ConfigError
from recaccel.preflight import make_data_hint, preflight


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as done:
        train_main(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _sections(cls: type, title: str):
    """Every (table title, dataclass) of a section, nested tables included."""
    yield title, cls
    for f in dataclasses.fields(cls):
        nested = _table_class(field_hints(cls)[f.name])
        if nested is not None:
            yield from _sections(nested[0], f"{title}.{f.name}{nested[1]}")


def test_help_lists_every_section_and_key_with_default_type_and_choices(capsys):
    text = _help(capsys)
    assert "--print-config" in text and "--version" in text
    assert "relative to that file's" in text and "--set values and the defaults" in text
    for name, cls in section_types().items():
        for title, table in _sections(cls, name):
            block = text.split(f"\n[{title}]", 1)[1].split("\n[", 1)[0]
            for f in dataclasses.fields(table):
                line = next((ln for ln in block.splitlines() if ln.startswith(f"  {f.name} = ")), None)
                assert line is not None, f"{title}.{f.name} missing from --help"
                hint = field_hints(table)[f.name]
                for choice in _choices(hint):
                    assert choice in line, (title, f.name, choice)
                for rule in _ranges(hint):
                    assert rule.requirement.removeprefix("must be ") in line, (title, f.name)
    assert "  batch_size = 512  (int >= 1)" in text
    assert '  invalid_ids = "error"  (one of: error, skip, clip, hash)' in text
    assert '  train = "data/synth/train"  (path)' in text
    assert "  eval_states = []  (list of name=path)" in text
    assert "  cache_fraction = 0.1  (float > 0 and <= 1)" in text


def _choices(hint) -> tuple[str, ...]:
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return tuple(c for arg in typing.get_args(hint) for c in _choices(arg))


def _ranges(hint) -> list[Range]:
    if typing.get_origin(hint) is typing.Annotated:
        return [r for r in typing.get_args(hint)[1:] if isinstance(r, Range)]
    if typing.get_origin(hint) is list:
        return _ranges(typing.get_args(hint)[0])
    return []


def test_help_carries_the_fields_comments_and_section_docs(capsys):
    text = _help(capsys)
    assert "[train]  The training loop." in text
    steps = text.split("\n  steps = 0  (int >= 0)\n", 1)[1].splitlines()[0]
    assert "stop after this many steps" in steps
    assert all(len(line) <= 100 for line in config_reference().splitlines())
    assert "Learning-rate schedule of both optimizers" in field_docs(section_types()["optim"])["schedule"]


def test_field_docs_prefer_metadata():
    @dataclass
    class Documented:
        a: int = field(default=1, metadata={"doc": "from metadata"})  # from the comment
        b: int = 2  # beside b
        # above c
        c: int = 3
        d: int = 4

    assert field_docs(Documented) == {"a": "from metadata", "b": "beside b", "c": "above c"}


@pytest.mark.parametrize(
    "hint, text",
    [
        (int, "int"),
        (typing.Annotated[float, Range(gt=0, le=1)], "float > 0 and <= 1"),
        (typing.Literal["a", "b"], "one of: a, b"),
        (list[typing.Literal["x", "y"]], "list, each one of: x, y"),
        (list[typing.Annotated[int, Range(ge=1)]], "list of int >= 1"),
        (str | None, "str, or unset"),
        (dict[str, int], "table of int"),
    ],
)
def test_describe_type(hint, text):
    assert describe_type(hint) == text


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        train_main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"recaccel-train {recaccel.__version__}"


def test_print_config_is_the_resolved_config_as_toml(tmp_path, capsys):
    base = tmp_path / "base.toml"
    base.write_text('[train]\nsteps = 3\nout_dir = "runs/x"\n[model]\nembedding_dim = 8\n')
    mine = tmp_path / "sub" / "mine.toml"
    mine.parent.mkdir()
    mine.write_text("[train]\nsteps = 5\n")
    argv = ["--config", str(base), "--config", str(mine), "--set", "optim.lr=0.5", "--print-config"]
    assert train_main(argv) == 0
    printed = capsys.readouterr().out
    cfg = config_from_dict(tomllib.loads(printed))
    assert cfg == load_config([base, mine], ["optim.lr=0.5"])
    assert (cfg.train.steps, cfg.model.embedding_dim, cfg.optim.lr) == (5, 8, 0.5)
    assert cfg.train.out_dir == str(tmp_path / "runs" / "x")
    for section in section_types():  # defaults included
        assert f"[{section}]" in printed
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_print_config_of_a_run_and_resume_with_config_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('[train]\nsteps = 4\nout_dir = "elsewhere"\n')
    assert train_main(["--resume", str(run), "--set", "train.seed=3", "--print-config"]) == 0
    cfg = config_from_dict(tomllib.loads(capsys.readouterr().out))
    assert (cfg.train.steps, cfg.train.seed, cfg.train.out_dir) == (4, 3, str(run))
    assert train_main(["--resume", str(run), "--config", str(run / "config.toml")]) == 2
    assert "--resume reads the run's own config.toml" in capsys.readouterr().err


def test_missing_synth_data_names_the_synth_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "configs" / "mine.toml"
    config.parent.mkdir()
    config.write_text('[synth]\nout_dir = "../data/mine"\n[data]\ntrain = "../data/mine/train"\n')
    extra = tmp_path / "more.toml"
    extra.write_text("[train]\nsteps = 2\n")
    assert train_main(["--config", str(config), "--config", "more.toml"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"data.train={tmp_path / 'data' / 'mine' / 'train'} does not exist" in err
    assert err.endswith(f"make it with: recaccel-data synth --config {config} --config more.toml")


@pytest.mark.parametrize(
    "sets, path, command",
    [
        ([], "data/synth/test", "recaccel-data synth"),
        (["synth.out_dir=s"], "s", "recaccel-data synth"),
        ([], "data/criteo10k/train", "recaccel-data criteo CRITEO_TSV {root}/data/criteo10k"),
        (["train.mode=meta"], "data/ml100k/test", "recaccel-data movielens ML_100K_DIR {root}/data/ml100k"),
        (["train.eval_tasks=true"], "x/train", "recaccel-data movielens ML_100K_DIR {root}/x"),
        (["train.mode=meta"], "d/melu/user_cold_state", "recaccel-data melu MELU_STATES_DIR {root}/d/melu"),
        ([], "d/melu/warm_state_valid", "recaccel-data melu MELU_STATES_DIR {root}/d/melu"),
        ([], "mine.parquet", None),
    ],
)
def test_missing_data_hint_follows_the_converters_conventions(tmp_path, monkeypatch, sets, path, command):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, sets)
    expected = None if command is None else command.format(root=tmp_path)
    assert make_data_hint(cfg, path) == expected


def test_missing_data_hint_in_preflight_and_none_for_own_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"data.test=x/test does not exist; make it with: recaccel-data criteo"
    ):
        cfg = load_config(None, ["data.train=x/train", "data.test=x/test"])
        Path("x/train").mkdir(parents=True)
        Path("x/train/part.parquet").write_bytes(b"")
        preflight(cfg)
    if "schema" in {f.name for f in dataclasses.fields(section_types()["data"])}:
        own = load_config(None, ['data.schema={label = "y", dense = ["a"]}'])
        assert make_data_hint(own, "data/synth/train") is None
    assert make_data_hint(cfg, "nowhere/else") is None


def _console_scripts() -> dict[str, str]:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    return pyproject["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(_console_scripts()))
def test_every_command_and_subcommand_prints_its_help(script, capsys):
    """argparse formats help lazily: a stray ``%`` in one help text crashes ``--help`` alone."""
    module, _, name = _console_scripts()[script].partition(":")
    main = getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    subcommands = re.findall(r"^\s+\{([\w,-]+)\}", listed, flags=re.M)
    for sub in subcommands[0].split(",") if subcommands else []:
        with pytest.raises(SystemExit) as done:
            main([sub, "--help"])
        assert done.value.code == 0, f"{script} {sub} --help"
