"""Error messages point somewhere real, and say what is wrong rather than a symptom.

The last tests read every message recaccel raises or logs (string literals found with
``ast``: the arguments of exception and logging calls, and the strings assigned to the
names those calls use) and check each ``recaccel.x.y`` name imports, each
``recaccel-<cmd> <sub>`` command exists, and each ``section.key`` config key is a field.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomllib

from recaccel.config import SchemaMapping, SparseColumn, load_config, section_types
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.schema import FeatureSchema, SparseField

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "recaccel"

# ---------------------------------------------------------------- the messages themselves


def _recaccel_file_with_duplicate(tmp_path: Path, name: str) -> Path:
    """A file carrying recaccel's schema metadata whose column ``name`` appears twice."""
    schema = FeatureSchema(dense=("d0",), sparse=(SparseField("s0", 10),))
    table = pa.table({"label": pa.array([1.0, 0.0], pa.float32()), "d0": pa.array([0.5, 1.5], pa.float32())})
    table = table.append_column("s0", pa.array([1, 2], pa.int64()))
    table = table.append_column(name, table.column(name))
    path = tmp_path / "dup.parquet"
    pq.write_table(table.replace_schema_metadata(schema.arrow_schema().metadata), path)
    return path


def test_a_column_that_appears_twice_is_named_with_its_count_not_as_missing(tmp_path):
    path = _recaccel_file_with_duplicate(tmp_path, "s0")
    with pytest.raises(DataError, match=rf"^column 's0' appears 2 times in {path}; rename"):
        open_dataset(path)
    plain = tmp_path / "plain.parquet"
    cols = [pa.array([1.0, 0.0]), pa.array([3, 4]), pa.array([5, 6]), pa.array([7, 8])]
    pq.write_table(pa.Table.from_arrays(cols, names=["y", "item", "item", "item"]), plain)
    mapping = SchemaMapping(label="y", sparse={"item": SparseColumn(cardinality=10)})
    with pytest.raises(DataError, match=rf"column 'item' appears 3 times in {plain}"):
        open_dataset(plain, mapping)


def test_a_toml_config_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")
    assert load_config(path).train.steps == 3
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xef\xbb\xbf[train]\nsteps = \xff\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(line 2: byte 0xff\)"):
        load_config(bad)


def test_a_file_without_recaccel_metadata_points_to_a_writer_that_exists(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"label": [1.0], "d0": [0.5]}), plain)
    with pytest.raises(DataError, match="no recaccel schema") as e:
        open_dataset(plain)
    [name] = re.findall(r"recaccel(?:\.\w+)+", str(e.value))
    module, _, attr = name.rpartition(".")
    write_parquet = getattr(importlib.import_module(module), attr)
    schema = FeatureSchema(dense=("d0",), sparse=())
    write_parquet(tmp_path / "ok", schema, {"label": np.array([1.0], np.float32), "d0": np.array([0.5])})
    assert open_dataset(tmp_path / "ok").num_rows == 1


def test_unsorted_mapped_task_data_points_to_a_rewrite_that_accepts_it(tmp_path):
    from recaccel.io.readers.tasks.reader import TaskReader

    rng = np.random.default_rng(4)
    n = 48
    df = pd.DataFrame(
        {
            "user_id": rng.permutation(np.repeat(np.arange(6), 8)),
            "movie": rng.integers(0, 40, n),
            "stars": rng.integers(1, 6, n).astype(float),
        }
    )
    src = tmp_path / "ratings.parquet"
    df.to_parquet(src, index=False, row_group_size=16)
    cfg = load_config(
        None,
        [
            'data.schema={label="stars", label_kind="rating", task_key="user_id", '
            "sparse={movie={cardinality=40}}}",
            "tasks.support_size=4",
            "tasks.query_size=2",
            "tasks.tasks_per_batch=2",
            "data.shuffle=false",
        ],
    )
    with pytest.raises(DataError, match="not sorted by task key") as e:
        TaskReader.from_config(src, cfg, train=False)
    assert "recaccel-data tasks" not in str(e.value)  # it refuses files without recaccel metadata
    [name] = re.findall(r"recaccel(?:\.\w+)+", str(e.value))
    module, _, attr = name.rpartition(".")
    rewrite = getattr(importlib.import_module(module), attr)
    report = rewrite(src, tmp_path / "grouped", task_key="user_id", schema=cfg.data.schema)
    assert (report.rows, report.tasks) == (n, 6)
    cfg.data.schema = None  # the rewrite is a recaccel dataset
    seen = [t for tb in TaskReader.from_config(tmp_path / "grouped", cfg, train=False) for t in tb.task_ids]
    assert sorted(int(t) for t in seen) == list(range(6))


# ---------------------------------------------------------------- every name a message gives

_MESSAGE_METHODS = {"warning", "error", "critical", "exception", "warn"}
_DOTTED = re.compile(r"(?<![\w./-])recaccel(?:\.[A-Za-z_]\w*)+")
_COMMAND = re.compile(r"(?<![\w./-])(recaccel-[a-z]+)(?: ([a-z][\w-]*))?")
_FILE_SUFFIXES = {"json", "jsonl", "toml", "md", "parquet", "pt", "pt2", "csv", "txt", "log"}


def _config_key_pattern() -> re.Pattern:
    sections = "|".join(section_types())
    return re.compile(rf"(?<![\w./-])({sections})\.([a-z_]\w*)")


def _is_message_call(call: ast.Call) -> bool:
    """An exception built, or a line logged or warned."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name.endswith(("Error", "Exception", "Warning")) or name in _MESSAGE_METHODS


def _literal_texts(node: ast.AST) -> Iterator[str]:
    """The string literals under ``node``; an f-string's fields read as ``{}``."""
    inner: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.JoinedStr):
            inner.update(id(v) for v in n.values)
            yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in n.values)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in inner:
            yield n.value


def _scope_messages(scope: ast.AST) -> Iterator[str]:
    """Message literals of one function (or module): the arguments of its message calls
    and the values assigned to the names those arguments use."""
    calls = [n for n in ast.walk(scope) if isinstance(n, ast.Call) and _is_message_call(n)]
    used = set()
    for call in calls:
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            yield from _literal_texts(arg)
            used.update(n.id for n in ast.walk(arg) if isinstance(n, ast.Name))
    for n in ast.walk(scope):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id in used for t in targets):
                yield from _literal_texts(n.value)


@functools.cache
def _messages() -> tuple[tuple[str, str], ...]:
    """(file, text) of every message literal in the package."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        scopes = [
            tree,
            *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
        ]
        for scope in scopes:
            found.update((str(path.relative_to(REPO)), text) for text in _scope_messages(scope))
    return tuple(sorted(found))


def _resolves(dotted: str) -> bool:
    """Whether ``recaccel.a.b.c`` is a module, or an attribute of the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@functools.cache
def _commands() -> dict[str, tuple[str, ...]]:
    """Each console script of pyproject.toml and its subcommands (none: empty)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    found = {}
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            getattr(importlib.import_module(module), func)(["--help"])
        usage = out.getvalue().split("\n\n", 1)[0]
        subs = re.search(r"\{([\w,-]+)\}", usage)
        found[name] = tuple(subs.group(1).split(",")) if subs else ()
    return found


def _config_keys() -> dict[str, set[str]]:
    return {name: {f.name for f in dataclasses.fields(cls)} for name, cls in section_types().items()}


def dangling_references(text: str) -> list[str]:
    """The names in a message that do not exist: ``recaccel.*`` names that do not import,
    ``recaccel-<cmd> [<sub>]`` commands that are not console scripts (or subcommands), and
    ``section.key`` config keys that are not fields."""
    bad = [m.group(0) for m in _DOTTED.finditer(text) if m.group(0).rsplit(".", 1)[1] not in _FILE_SUFFIXES]
    bad = [name for name in bad if not _resolves(name)]
    commands = _commands()
    for m in _COMMAND.finditer(text):
        cmd, sub = m.groups()
        if cmd not in commands:
            bad.append(cmd)
        elif sub and commands[cmd] and sub not in commands[cmd]:
            bad.append(f"{cmd} {sub}")
    keys = _config_keys()
    for m in _config_key_pattern().finditer(text):
        section, key = m.groups()
        if key not in _FILE_SUFFIXES and key not in keys[section]:
            bad.append(m.group(0))
    return bad


def test_the_reference_check_flags_names_that_do_not_exist():
    assert dangling_references("write with recaccel.io.readers.rows.write_parquet") == [
        "recaccel.io.readers.rows.write_parquet"
    ]
    assert dangling_references("run recaccel-data sort first, or recaccel-convert") == [
        "recaccel-data sort",
        "recaccel-convert",
    ]
    assert dangling_references("config key data.train_path=x, model.embedding_dim=4") == ["data.train_path"]
    assert (
        dangling_references(
            "use recaccel.io.format.write_parquet, recaccel-data tasks, recaccel-train with "
            "data.unreadable_files; see docs/data.md and synth.json"
        )
        == []
    )


def test_the_scan_reads_the_messages_of_the_whole_package():
    texts = " ".join(text for _, text in _messages())
    assert len(_config_key_pattern().findall(texts)) >= 50
    assert len(_DOTTED.findall(texts)) >= 2
    assert "recaccel-data tasks" in texts
    assert "recaccel.io.convert.group_by_task.group_by_task" in texts  # assigned, then raised


def test_every_name_an_error_message_gives_exists():
    bad = [
        f"{path}: {name!r} in {text!r}" for path, text in _messages() for name in dangling_references(text)
    ]
    assert bad == []
