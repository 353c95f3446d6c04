"""Every config field refuses bad values in one line naming it, and the CLI exits 2.

The fields are enumerated with ``dataclasses.fields`` and their rules read from their
annotations (``Literal`` choices, ``Range``, ``Pattern``), so a new field is covered as
soon as it is declared; a numeric field without a declared range fails the suite.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest

from recaccel import api
from recaccel.cli import train_main
from recaccel.config import (
    Config,
    Pattern,
    Range,
    TrainConfig,
    config_from_dict,
    field_hints,
    load_config,
    section_types,
)
from recaccel.errors import ConfigError
from recaccel.io.convert.synth import generate_synthetic
from recaccel.preflight import preflight


def _is_table(hint: Any) -> bool:
    """A nested table field ([data.schema]: its rules are tested in tests/io/test_schema_mapping.py;
    model.init_args, the arguments of one's own model: in tests/train/model/test_class_path.py)."""
    if typing.get_origin(hint) is dict:
        return True
    return any(isinstance(a, type) and dataclasses.is_dataclass(a) for a in (hint, *typing.get_args(hint)))


FIELDS = [
    (f"{section}.{f.name}", field_hints(cls)[f.name])
    for section, cls in section_types().items()
    for f in dataclasses.fields(cls)
    if not _is_table(field_hints(cls)[f.name])
]


def _split(hint: Any) -> tuple[Any, list[Any]]:
    """(the type under ``Annotated``, its rules); for a number-or-word union
    (``NonNegative | Literal["auto"]``) those of the number, whose rules are the ones to test."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) is Annotated:
        base, *rules = typing.get_args(hint)
        return base, rules
    return hint, []


def _item(hint: Any) -> Any:
    """The item annotation of a ``list[...]`` field, else the annotation itself."""
    base, _ = _split(hint)
    return typing.get_args(base)[0] if typing.get_origin(base) is list else hint


def _is_list(hint: Any) -> bool:
    return typing.get_origin(_split(hint)[0]) is list


def _scalar(hint: Any) -> Any:
    """The plain type (int, float, bool, str) or Literal of a field or of its items."""
    return _split(_item(hint))[0]


def _rules(hint: Any, kind: type) -> list[Any]:
    return [r for r in _split(_item(hint))[1] if isinstance(r, kind)]


def _wrong_types(hint: Any) -> list[Any]:
    """Values of the wrong type for a field (for a list field: not a list, and a list
    holding a wrong item)."""
    scalar = _scalar(hint)
    if typing.get_origin(scalar) is Literal:
        wrong = [5, True]
    else:
        wrong = {bool: [1, "yes"], int: ["many", 1.5, True], float: ["fast", True], str: [5, False]}[scalar]
    return [3, "x", [wrong[0]]] if _is_list(hint) else wrong


def _outside(rng: Range, scalar: type) -> list[float]:
    """Values just outside ``rng``: one per bound, plus non-finite floats."""
    step = 1 if scalar is int else 0.5
    values = [
        *([rng.ge - step] if rng.ge is not None else []),
        *([rng.gt] if rng.gt is not None else []),
        *([rng.le + step] if rng.le is not None else []),
        *([rng.lt] if rng.lt is not None else []),
    ]
    values = [int(v) if scalar is int else float(v) for v in values]
    return values + ([math.nan, math.inf, -math.inf] if scalar is float else [])


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)  # ints; floats incl. nan / inf, which TOML spells the same


def _refused(key: str, value: Any) -> str:
    """The message for ``key = value`` given as an override and as a dict; both must be
    one ConfigError line naming the key."""
    section, name = key.split(".")
    messages = []
    for build in (
        lambda: load_config(None, [f"{key}={_toml(value)}"]),
        lambda: config_from_dict({section: {name: value}}),
    ):
        with pytest.raises(ConfigError) as err:
            build()
        messages.append(str(err.value))
    for message in messages:
        assert "\n" not in message and f"{key}" in message, message
    assert messages[0] == messages[1]
    return messages[0]


def _ids(fields: list[tuple[str, Any]]) -> list[str]:
    return [key for key, _ in fields]


NUMERIC = [(k, h) for k, h in FIELDS if _scalar(h) in (int, float)]
CHOICES = [(k, h) for k, h in FIELDS if typing.get_origin(_scalar(h)) is Literal]
PATTERNS = [(k, h) for k, h in FIELDS if _rules(h, Pattern)]


def test_fields_are_enumerated_and_defaults_are_valid():
    assert len(FIELDS) > 60 and {"train.log_every", "optim.lr", "parallel.timeout_s"} <= set(_ids(FIELDS))
    assert all(cls.SECTION == name for name, cls in section_types().items())
    Config()  # every default satisfies its own rules
    for key, hint in FIELDS:
        assert _scalar(hint) in (bool, int, float, str) or typing.get_origin(_scalar(hint)) is Literal, key


def test_every_numeric_field_declares_its_range():
    missing = [key for key, hint in NUMERIC if not _rules(hint, Range)]
    assert not missing, f"declare a Range for {missing}"


@pytest.mark.parametrize("key, hint", FIELDS, ids=_ids(FIELDS))
def test_wrong_type_is_one_line_naming_the_key(key, hint):
    for value in _wrong_types(hint):
        _refused(key, value)


@pytest.mark.parametrize("key, hint", NUMERIC, ids=_ids(NUMERIC))
def test_out_of_range_is_one_line_naming_the_key(key, hint):
    scalar = _scalar(hint)
    (rng,) = _rules(hint, Range)
    for value in _outside(rng, scalar):
        message = _refused(key, [value] if _is_list(hint) else value)
        if math.isfinite(value):
            assert rng.requirement in message, message
    if not _is_list(hint):  # an inclusive bound itself is allowed
        section, name = key.split(".")
        for bound in (rng.ge, rng.le):
            if bound is not None:
                built = config_from_dict({section: {name: scalar(bound)}})
                assert getattr(getattr(built, section), name) == bound


@pytest.mark.parametrize("key, hint", CHOICES, ids=_ids(CHOICES))
def test_wrong_choice_is_one_line_naming_the_key(key, hint):
    allowed = typing.get_args(_scalar(hint))

    def given(value):  # a list field takes its choices as items
        return [value] if _is_list(hint) else value

    assert "one of" in _refused(key, given("no_such_choice"))
    assert "did you mean" in _refused(key, given(allowed[0] + "x"))
    section, name = key.split(".")
    for choice in allowed:
        assert getattr(getattr(config_from_dict({section: {name: given(choice)}}), section), name) == given(
            choice
        )


@pytest.mark.parametrize("key, hint", PATTERNS, ids=_ids(PATTERNS))
def test_malformed_string_is_one_line_naming_the_key(key, hint):
    (pattern,) = _rules(hint, Pattern)
    assert "" not in pattern
    message = _refused(key, [""] if _is_list(hint) else "")
    assert pattern.requirement in message


def test_sections_check_on_construction_and_preflight_rechecks_changed_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key train\.log_every=0 must be >= 1$"):
        TrainConfig(log_every=0)
    cfg = Config()
    cfg.train.log_every = 0  # changed after it was built
    with pytest.raises(ConfigError, match=r"train\.log_every=0"):
        preflight(cfg)


def test_a_train_seed_past_32_bits_is_refused_in_one_line():
    """train.seed reaches numpy's global generator (np.random.seed), which takes 32 bits: a
    larger one was a traceback. data.seed and synth.seed reach default_rng: any size."""
    with pytest.raises(
        ConfigError, match=r"^config key train\.seed=4294967296 must be >= 0 and <= 4294967295$"
    ):
        load_config(None, ["train.seed=4294967296"])
    assert load_config(None, ["train.seed=4294967295"]).train.seed == 2**32 - 1
    wide = load_config(None, [f"data.seed={2**40}", f"synth.seed={2**40}"])
    assert wide.data.seed == wide.synth.seed == 2**40


def test_zero_keeps_its_documented_meanings():
    cfg = load_config(
        None,
        [
            "train.steps=0",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "data.prefetch=0",
            "data.read_ahead=0",
            "meta.inner_steps=0",
            "tasks.query_count=0",
            "tasks.query_fraction=0",
        ],
    )
    t, d = cfg.train, cfg.data
    assert (t.steps, t.eval_every, t.checkpoint_every, d.prefetch, d.read_ahead) == (0, 0, 0, 0, 0)
    assert (cfg.meta.inner_steps, cfg.tasks.query_count, cfg.tasks.query_fraction) == (0, 0, 0.0)


def test_config_file_problems_are_one_line(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[train]\nout_dir = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"latin1\.toml is not UTF-8 text \(line 2: byte 0xe9\)"):
        load_config(latin1)
    flat = tmp_path / "flat.toml"
    flat.write_text("train = 5\n")
    for overrides in ([], ["train.steps=1"]):  # the override used to index into the 5
        with pytest.raises(ConfigError, match=r"flat\.toml: config section \[train\] must be a table"):
            load_config(flat, overrides)
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(tmp_path)


# ---------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    cfg = load_config(
        None,
        [
            "synth.train_rows=600",
            "synth.test_rows=300",
            "synth.num_dense=2",
            "synth.num_sparse=2",
            "synth.cardinality=20",
            "synth.rows_per_row_group=300",
            f'synth.out_dir="{root}"',
        ],
    )
    generate_synthetic(cfg.synth)
    return root


def _run(tiny: Path, out: Path, *extra: str, argv: tuple[str, ...] = ()) -> list[str]:
    sets = [
        f'data.train="{tiny / "train"}"',
        f'data.test="{tiny / "test"}"',
        f'train.out_dir="{out}"',
        "data.batch_size=100",
        "model.embedding_dim=4",
        "model.bottom_mlp=[4]",
        "model.top_mlp=[4, 1]",
        "model.embedding_backend=reference",
        "train.steps=2",
        "train.device=cpu",
        "train.progress=false",
        *extra,
    ]
    return [*argv, *(arg for s in sets for arg in ("--set", s))]


def _one_line_exit_2(capsys, argv: list[str], *fragments: str) -> str:
    assert train_main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("recaccel-train: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_the_base_run_trains(tiny, tmp_path):
    assert train_main(_run(tiny, tmp_path / "run")) == 0  # so each case below fails for its one change


@pytest.mark.parametrize(
    "bad",
    [
        "train.epochs=0",
        "train.epochs=-2",
        "train.steps=-5",
        "train.log_every=0",
        "train.log_every=-1",
        "train.checkpoint_every=-1",
        "train.eval_every=-1",
        "data.prefetch=-1",
        "optim.lr=inf",
        "optim.lr=-0.1",
        "optim.lr=nan",
        "data.eval_batch_size=0",
        "optim.sparse_lr=-1",
    ],
)
def test_bad_value_exits_2_in_one_line_before_any_work(tiny, tmp_path, capsys, bad):
    out = tmp_path / "run"
    _one_line_exit_2(capsys, _run(tiny, out, bad), f"config key {bad} must be")
    assert not out.exists()


def test_missing_inputs_are_found_before_training(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    missing = tmp_path / "missing"
    for key in ("data.test", "data.train"):
        argv = _run(tiny, out, f'{key}="{missing}"')
        _one_line_exit_2(capsys, argv, f"config key {key}={missing} does not exist")
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(capsys, _run(tiny, out, f'data.test="{tmp_path / "empty"}"'), "without *.parquet files")
    states = _run(tiny, out, f'meta.eval_states=["cold={missing}"]')
    _one_line_exit_2(capsys, states, f"meta.eval_states[0]=cold={missing} does not exist")
    assert not out.exists()  # no config.toml, log, checkpoint or metrics were written


def test_out_dir_naming_a_file(tiny, tmp_path, capsys):
    file = tmp_path / "taken"
    file.write_text("not a run directory")
    _one_line_exit_2(capsys, _run(tiny, file), f"train.out_dir={file} is a file")
    _one_line_exit_2(capsys, _run(tiny, file / "run"), f"train.out_dir={file / 'run'} lies inside {file}")
    assert file.read_text() == "not a run directory"


@pytest.mark.parametrize("key", ["embedding_backend", "interaction_backend"])
def test_triton_on_cpu_without_the_interpreter(tiny, tmp_path, capsys, monkeypatch, key):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    line = _one_line_exit_2(capsys, _run(tiny, tmp_path / "run", f"model.{key}=triton"))
    assert line.endswith(f"config key model.{key}=triton needs a CUDA device or TRITON_INTERPRET=1")
    assert not (tmp_path / "run").exists()


def test_config_file_errors_through_the_cli(tiny, tmp_path, capsys):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"[train]\nsteps = 2 # \xff\n")
    _one_line_exit_2(capsys, ["--config", str(latin1)], str(latin1), "not UTF-8")
    flat = tmp_path / "flat.toml"
    flat.write_text("train = 5\n")
    argv = _run(tiny, tmp_path / "run", argv=("--config", str(flat)))  # each --set train.* indexed into 5
    _one_line_exit_2(capsys, argv, str(flat), "[train] must be a table")


def test_hybrid_with_zero_timeout_is_refused_before_launching(tiny, tmp_path, capsys):
    argv = _run(tiny, tmp_path / "run", "parallel.mode=hybrid", "parallel.timeout_s=0", argv=("--nproc", "2"))
    _one_line_exit_2(capsys, argv, "config key parallel.timeout_s=0 must be > 0")


def test_hybrid_with_missing_data_is_refused_before_launching(tiny, tmp_path, capsys, monkeypatch):
    from recaccel.train.distributed import launch

    def no_launch(*_args, **_kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "relaunch", no_launch)
    missing = tmp_path / "missing"
    argv = _run(
        tiny, tmp_path / "run", "parallel.mode=hybrid", f'data.test="{missing}"', argv=("--nproc", "2")
    )
    _one_line_exit_2(capsys, argv, f"config key data.test={missing} does not exist")


def test_evaluate_checks_its_data_before_reading_the_run(tiny, tmp_path):
    cfg = load_config(None, _run(tiny, tmp_path / "run")[1::2])
    with pytest.raises(ConfigError, match=r"evaluation data .*nope does not exist"):
        api.evaluate(cfg, str(tmp_path / "nope"))
