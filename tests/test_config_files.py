"""Config files: several merged left to right, paths relative to their file, a run's own
config.toml read back as written (so old and new run directories resume)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from recaccel.api import absolute_paths, run_config
from recaccel.config import (
    NamedPath,
    PathText,
    config_to_toml,
    field_hints,
    load_config,
    path_fields,
    section_types,
)
from recaccel.errors import ConfigError
from tests.helpers.dlrm_run import TINY


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_files_merge_left_to_right_key_by_key_then_overrides(tmp_path):
    a = _write(
        tmp_path / "a.toml", "[train]\nsteps = 3\nseed = 7\n[model]\nembedding_dim = 8\ntop_mlp = [4, 2, 1]\n"
    )
    b = _write(tmp_path / "b.toml", "[train]\nsteps = 5\n[model]\ntop_mlp = [3, 1]\n[optim]\nlr = 0.5\n")
    cfg = load_config([a, b])
    assert cfg.train.steps == 5 and cfg.train.seed == 7  # b wins where it speaks, a's other keys stay
    assert cfg.model.embedding_dim == 8 and cfg.model.top_mlp == [3, 1]  # a list is replaced whole
    assert cfg.optim.lr == 0.5
    assert load_config([b, a]).train.steps == 3
    assert load_config([a, b], ["train.steps=9"]).train.steps == 9
    assert load_config([str(a)]) == load_config(a)
    assert load_config([]) == load_config(None)


def test_nested_tables_merge_key_by_key(tmp_path):
    if "schema" not in {f.name for f in dataclasses.fields(section_types()["data"])}:
        pytest.skip("no [data.schema] table in this config")
    a = _write(
        tmp_path / "a.toml",
        '[data.schema]\nlabel = "click"\ndense = ["x"]\n[data.schema.sparse]\nu = {hash = 8}\n',
    )
    b = _write(
        tmp_path / "b.toml", '[data.schema]\ndense = ["y"]\n[data.schema.sparse]\ni = {cardinality = 4}\n'
    )
    schema = load_config([a, b]).data.schema
    assert schema.label == "click" and schema.dense == ["y"]
    assert set(schema.sparse) == {"u", "i"}


def test_a_bad_file_among_several_is_named(tmp_path):
    good = _write(tmp_path / "good.toml", "[train]\nsteps = 3\n")
    bad = _write(tmp_path / "bad.toml", "[train]\nstesp = 3\n")
    with pytest.raises(ConfigError, match="did you mean train.steps"):
        load_config([good, bad])
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config([good, tmp_path / "missing.toml"])


def test_path_fields_are_every_path_annotation():
    found = {(s, k) for s, cls in section_types().items() for k in path_fields(cls)}
    assert {("data", "train"), ("data", "test"), ("train", "out_dir"), ("synth", "out_dir")} <= found
    assert ("meta", "eval_states") in found and path_fields(section_types()["meta"])["eval_states"] is True
    # Every field whose annotation mentions PathText or NamedPath, and no other.
    expected = set()
    for section, cls in section_types().items():
        for key, hint in field_hints(cls).items():
            if any(
                alias == hint or alias in getattr(hint, "__args__", ()) for alias in (PathText, NamedPath)
            ):
                expected.add((section, key))
    assert found == expected


def test_paths_in_a_file_are_relative_to_that_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sub = tmp_path / "configs" / "sub"
    cfg_file = _write(
        sub / "c.toml",
        '[data]\ntrain = "../../data/x/train"\n'
        '[train]\nout_dir = "runs/x"\n'
        '[synth]\nout_dir = "/abs/synth"\n'
        '[meta]\neval_states = ["cold=../cold", "warm=/abs/warm"]\n',
    )
    cfg = load_config(Path("configs/sub/c.toml"), ['data.test="rel/test"'])
    assert cfg.data.train == str(tmp_path / "data" / "x" / "train")
    assert cfg.train.out_dir == str(sub / "runs" / "x")
    assert cfg.synth.out_dir == "/abs/synth"  # absolute stays
    assert cfg.meta.eval_states == [f"cold={tmp_path / 'configs' / 'cold'}", "warm=/abs/warm"]
    assert cfg.data.test == "rel/test"  # an override stays relative to the working directory
    assert load_config(cfg_file).data.test == "data/synth/test"  # so does a default
    # Read as written (a run directory's config.toml):
    raw = load_config(cfg_file, paths_relative_to_file=False)
    assert raw.data.train == "../../data/x/train" and raw.train.out_dir == "runs/x"


def test_each_file_resolves_against_its_own_folder(tmp_path):
    a = _write(tmp_path / "one" / "a.toml", '[data]\ntrain = "t"\ntest = "u"\n')
    b = _write(tmp_path / "two" / "b.toml", '[data]\ntest = "v"\n')
    cfg = load_config([a, b])
    assert cfg.data.train == str(tmp_path / "one" / "t")
    assert cfg.data.test == str(tmp_path / "two" / "v")


def test_a_bad_path_value_is_left_for_the_field_check(tmp_path):
    bad = _write(tmp_path / "c.toml", "[data]\ntrain = 3\n")
    with pytest.raises(ConfigError, match="data.train=3 must be a string"):
        load_config(bad)
    bad.write_text('[meta]\neval_states = ["nameless"]\n')
    with pytest.raises(ConfigError, match="name=path"):
        load_config(bad)


def test_presets_resolve_from_any_working_directory(repo_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(repo_root / "configs" / "debug.toml")
    assert cfg.data.train == str(repo_root / "data" / "debug" / "train")
    assert cfg.synth.out_dir == str(repo_root / "data" / "debug")
    assert cfg.train.out_dir == str(repo_root / "runs" / "debug")
    for path in sorted((repo_root / "configs").glob("*.toml")):  # none points inside configs/
        c = load_config(path)
        for value in (c.data.train, c.data.test, c.train.out_dir, c.synth.out_dir):
            assert not Path(value).is_relative_to(repo_root / "configs"), (path.name, value)


def test_absolute_paths_and_run_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ['meta.eval_states=["s=st"]', "train.out_dir=run"])
    resolved = absolute_paths(cfg)
    assert resolved.data.train == str(tmp_path / "data" / "synth" / "train")
    assert resolved.meta.eval_states == [f"s={tmp_path / 'st'}"]
    assert resolved.train.out_dir == str(tmp_path / "run") and resolved.model == cfg.model
    assert absolute_paths(resolved) == resolved
    # A run directory's config.toml: relative paths (older runs) mean the working directory.
    run = tmp_path / "run"
    _write(run / "config.toml", config_to_toml(cfg))
    again = run_config(run, ["train.steps=4"])
    assert again.data.train == "data/synth/train" and again.train.steps == 4
    assert again.train.out_dir == str(run)
    # An absolute one (new runs) reads the same from anywhere.
    (run / "config.toml").write_text(config_to_toml(resolved))
    monkeypatch.chdir(Path(os.sep))
    assert run_config(run).data.train == str(tmp_path / "data" / "synth" / "train")


def test_a_run_from_a_config_file_resumes_from_another_folder(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    """data.train / train.out_dir relative to the config file; the run's config.toml holds
    them absolute, so --resume works from any working directory."""
    import json

    from recaccel.cli import train_main

    config = _write(
        tmp_path / "cfgs" / "run.toml",
        f'[data]\ntrain = "{os.path.relpath(tiny_data / "train", tmp_path / "cfgs")}"\n'
        f'test = "{os.path.relpath(tiny_data / "test", tmp_path / "cfgs")}"\n'
        '[train]\nout_dir = "../runs/r"\nsteps = 6\n',
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    sets = [a for s in TINY for a in ("--set", s)]
    assert train_main(["--config", str(config), *sets]) == 0
    run = tmp_path / "runs" / "r"
    written = load_config(run / "config.toml", paths_relative_to_file=False)
    assert written.data.train == str(tiny_data / "train") and written.train.out_dir == str(run)
    monkeypatch.chdir(tmp_path / "cfgs")
    assert train_main(["--resume", os.path.relpath(run), "--set", "train.steps=9"]) == 0
    assert json.loads((run / "metrics.json").read_text())["steps"] == 9
