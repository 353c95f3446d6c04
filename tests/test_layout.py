"""The package's layout rules, read from the source with ``ast`` (nothing is imported).

Every ``import`` counts, at module level or inside a function (a lazy import still runs,
and still closes a cycle). Imports under ``if TYPE_CHECKING:`` are left out of the rules
between areas (they never run) but count for cycles (two modules that name each other's
types are one module in two files).
``from x import y`` resolves to the module ``x.y`` when ``y`` is a submodule, else to
``x``; a package's ``__init__`` re-exporting from its submodules is an edge from the
package to each of them. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and
``a.b``; those implicit parents are not edges (every module would otherwise sit in a
cycle with its package).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "recaccel"

# Modules everything may import: they sit under the whole graph.
BOTTOM = (
    "recaccel.config",
    "recaccel.errors",
    "recaccel.metrics",
    "recaccel.hashing",
    "recaccel.sparse",
    "recaccel.lazy",
    "recaccel.output_paths",
)
# Dotted names in README.md that are not Python names (a Parquet key-value metadata key).
README_NOT_MODULES = frozenset({"recaccel.schema"})


@dataclass(frozen=True)
class Import:
    """One import of a recaccel module by another."""

    source: str  # the importing module, e.g. recaccel.io.readers.rows
    target: str  # the imported module, resolved
    where: str  # "recaccel/io/readers/rows.py:62: from recaccel... import ..."


def within(module: str, area: str) -> bool:
    """Whether ``module`` is ``area`` or lies inside the package ``area``."""
    return module == area or module.startswith(area + ".")


def within_any(module: str, areas: tuple[str, ...]) -> bool:
    return any(within(module, area) for area in areas)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of recaccel by dotted name (a package under its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST, annotations: bool = False) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its else branch
    stays), unless ``annotations``: then every node."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not annotations and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _from_base(source: str, node: ast.ImportFrom) -> str:
    """The module ``from <base> import ...`` names, relative imports made absolute."""
    if node.level == 0:
        return node.module or ""
    package = source if is_package(source) else source.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(source: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = _from_base(source, node)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in modules() else base


@functools.cache
def imports(annotations: bool = False) -> tuple[Import, ...]:
    """Every run-time import of a recaccel module inside recaccel (with ``annotations``,
    those under ``if TYPE_CHECKING:`` too)."""
    found = []
    for source, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _runtime_nodes(tree, annotations):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}"
            for target in dict.fromkeys(_targets(source, node)):
                if within(target, "recaccel"):
                    found.append(Import(source, target, where))
    return tuple(found)


def violations(source_in: Callable[[str], bool], forbidden: Callable[[Import], bool]) -> list[str]:
    return [
        f"{imp.source} imports {imp.target} ({imp.where})"
        for imp in imports()
        if source_in(imp.source) and forbidden(imp)
    ]


def assert_none(found: list[str], rule: str) -> None:
    assert not found, f"{rule}; broken by:\n  " + "\n  ".join(found)


def _reexport(imp: Import) -> bool:
    """A package's ``__init__`` importing one of its own submodules (naming its public API)."""
    return is_package(imp.source) and within(imp.target, imp.source) and imp.target != imp.source


# ------------------------------------------------------------------ rules between areas


def test_format_imports_nothing_else_from_io():
    assert_none(
        violations(
            lambda m: within(m, "recaccel.io.format"),
            lambda imp: within(imp.target, "recaccel.io") and not within(imp.target, "recaccel.io.format"),
        ),
        "recaccel.io.format imports nothing else from recaccel.io",
    )


def test_readers_import_only_format_sparse_and_bottom():
    allowed = ("recaccel.io.format", "recaccel.io.readers", *BOTTOM)
    assert_none(
        violations(
            lambda m: within(m, "recaccel.io.readers"),
            lambda imp: not within_any(imp.target, allowed),
        ),
        f"readers (recaccel.io.readers.*) import only {', '.join(allowed)} "
        "(never a converter, the loader or anything above io)",
    )


def _converter(module: str) -> str:
    """The converter a module of ``recaccel.io.convert`` belongs to (a module or package)."""
    return ".".join(module.split(".")[:4])


def test_converters_import_only_format_sparse_and_bottom():
    allowed = ("recaccel.io.format", *BOTTOM)
    assert_none(
        violations(
            lambda m: within(m, "recaccel.io.convert"),
            lambda imp: (
                not within_any(imp.target, allowed)
                and not _reexport(imp)
                and not (imp.source != "recaccel.io.convert" and within(imp.target, _converter(imp.source)))
            ),
        ),
        f"converters (recaccel.io.convert.*) import only {', '.join(allowed)} and their own "
        "package's modules (never a reader, nor each other: what two converters share belongs in format)",
    )


def test_ops_imports_no_io_train_meta_or_models():
    above = ("recaccel.io", "recaccel.train", "recaccel.meta", "recaccel.models")
    assert_none(
        violations(lambda m: within(m, "recaccel.ops"), lambda imp: within_any(imp.target, above)),
        f"recaccel.ops imports none of {', '.join(above)}",
    )


def test_models_import_no_train_or_meta():
    above = ("recaccel.train", "recaccel.meta")
    assert_none(
        violations(lambda m: within(m, "recaccel.models"), lambda imp: within_any(imp.target, above)),
        f"recaccel.models imports none of {', '.join(above)}",
    )


def test_meta_imports_no_train():
    assert_none(
        violations(lambda m: within(m, "recaccel.meta"), lambda imp: within(imp.target, "recaccel.train")),
        "recaccel.meta imports no recaccel.train",
    )


def test_nothing_imports_cli_or_bench():
    def forbidden(imp: Import) -> bool:
        if within(imp.target, "recaccel.cli"):
            return not within(imp.source, "recaccel.cli")
        if within(imp.target, "recaccel.bench"):
            return not within_any(imp.source, ("recaccel.cli.bench", "recaccel.bench"))
        return False

    assert_none(
        violations(lambda m: True, forbidden),
        "only recaccel.cli imports recaccel.cli, and only recaccel-bench's entry (recaccel.cli.bench) "
        "imports recaccel.bench (the benchmarks import each other; plots come from recaccel.plotting)",
    )


# ------------------------------------------------------------------ cycles


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start through ``members`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(came_from[chain[-1]])
                    return [start, *reversed(chain[:-1]), start]
                if succ not in came_from:
                    came_from[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in no cycle")


# train/ and bench/ are being reorganised; remove entries as they are split. Each is a
# cycle group of today (annotation-only imports included): the test fails on any other
# cycle, and on an entry that is no longer a cycle group, so the list only shrinks.
CYCLES_BEING_SPLIT: tuple[frozenset[str], ...] = ()


def import_graph(annotations: bool) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Module -> the modules it imports, and the line of each edge."""
    graph: dict[str, set[str]] = {module: set() for module in modules()}
    lines: dict[tuple[str, str], str] = {}
    for imp in imports(annotations):
        if imp.target in graph:
            graph[imp.source].add(imp.target)
            lines.setdefault((imp.source, imp.target), imp.where)
    return graph, lines


def cycle_groups(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components that hold a cycle."""
    return [
        component
        for component in strongly_connected(graph)
        if len(component) > 1 or component[0] in graph[component[0]]
    ]


def describe_cycle(
    graph: dict[str, set[str]], lines: dict[tuple[str, str], str], component: list[str]
) -> str:
    chain = shortest_cycle(graph, component[0], set(component))
    edges = "".join(f"\n      {lines[a, b]}" for a, b in zip(chain, chain[1:]))
    others = sorted(set(component) - set(chain))
    also = f"\n      (same cycle group: {', '.join(others)})" if others else ""
    return " -> ".join(chain) + edges + also


def test_no_import_cycles():
    graph, lines = import_graph(annotations=True)
    groups = cycle_groups(graph)
    found = [describe_cycle(graph, lines, c) for c in groups if frozenset(c) not in CYCLES_BEING_SPLIT]
    assert_none(
        found,
        "no import cycle in recaccel (lazy imports, package re-exports and TYPE_CHECKING imports count)",
    )
    gone = [", ".join(sorted(c)) for c in CYCLES_BEING_SPLIT if c not in {frozenset(g) for g in groups}]
    assert_none(gone, "CYCLES_BEING_SPLIT lists only today's cycle groups (remove an entry once it is split)")


def test_cycle_check_counts_annotation_only_imports(tmp_path):
    # A TYPE_CHECKING import never runs, but it still ties two modules into one.
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import recaccel.errors\n"
    nodes = list(_runtime_nodes(ast.parse(source), annotations=True))
    assert any(isinstance(n, ast.Import) for n in nodes)
    assert not any(isinstance(n, ast.Import) for n in _runtime_nodes(ast.parse(source)))
    assert cycle_groups({"a": {"b"}, "b": {"a"}, "c": {"c"}, "d": set()}) == [["a", "b"], ["c"]]


def test_import_recaccel_does_not_import_torch():
    probe = (
        "import sys, recaccel; "
        "print(' '.join(m for m in ('torch', 'torchrec', 'triton') if m in sys.modules)); "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('recaccel'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    heavy, loaded = done.stdout.splitlines()
    assert not heavy, f"`import recaccel` imports {heavy}; recaccel modules it loaded: {loaded}"


# ------------------------------------------------------------------ public API of each package


def _all_names(tree: ast.Module) -> list[str] | str:
    """The names a module's ``__all__`` lists, or why they cannot be read."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = node.value
            if not isinstance(value, ast.List | ast.Tuple) or not all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
            ):
                return f"__all__ is not a literal list of strings (line {node.lineno})"
            return [e.value for e in value.elts]
    return "defines no __all__"


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Statements that run at import, through if/try blocks (not under TYPE_CHECKING)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            stack.extend(node.orelse if _is_type_checking(node.test) else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                stack.extend(handler.body)
        else:
            yield node


@functools.cache
def bindings(module: str) -> dict[str, tuple[str, str] | None]:
    """Names ``module`` binds at import: None for a local definition, (base, name) for a
    ``from base import name`` (``base`` absolute)."""
    tree = ast.parse(modules()[module].read_text())
    bound: dict[str, tuple[str, str] | None] = {}
    for node in _top_level(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound[node.name] = None
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        bound[name.id] = None
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.partition(".")[0]] = None
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                bound[alias.asname or alias.name] = (base, alias.name)
    return bound


def resolve(module: str, name: str, seen: frozenset[str] = frozenset()) -> str | None:
    """None when ``module.name`` exists (statically), else why not. Names imported from
    outside recaccel are taken as they are: optional dependencies (torchrec, triton,
    fbgemm_gpu) may be absent, and nothing is imported here."""
    if f"{module}.{name}" in modules():
        return None
    bound = bindings(module).get(name, "missing")
    if bound is None:
        return None
    if bound == "missing":
        if "__getattr__" in bindings(module):
            return None  # a lazy module attribute: cannot be read statically
        return f"{module} defines no {name}"
    base, original = bound
    if not within(base, "recaccel"):
        return None
    if base not in modules():
        return f"{module} imports {original} from {base}, which is no module"
    if (base, original) in seen:
        return f"{module}.{name} is imported in a circle"
    return resolve(base, original, seen | {(base, original)})


def packages() -> list[str]:
    return [module for module in modules() if is_package(module)]


def test_every_package_names_its_public_api():
    found = []
    for package in packages():
        path = modules()[package]
        listed = _all_names(ast.parse(path.read_text()))
        if isinstance(listed, str):
            found.append(f"{path.relative_to(REPO)}: {listed}")
            continue
        doubled = sorted({name for name in listed if listed.count(name) > 1})
        if doubled:
            found.append(f"{path.relative_to(REPO)}: __all__ lists {', '.join(doubled)} twice")
        found += [
            f"{path.relative_to(REPO)}: __all__ lists {name!r}: {why}"
            for name in listed
            if (why := resolve(package, name))
        ]
    assert_none(found, "every package __init__ under recaccel defines __all__, each name in it resolving")


def test_resolver_sees_a_missing_name_and_a_cycle_chain():
    # The checks above can fail: a re-export of a name that does not exist is caught,
    # and a two-module loop is reported as a chain.
    assert resolve("recaccel.errors", "NoSuchError") == "recaccel.errors defines no NoSuchError"
    assert resolve("recaccel", "RecaccelError") is None
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set()}
    assert strongly_connected(graph) == [["c"], ["a", "b"]]
    assert shortest_cycle(graph, "a", {"a", "b"}) == ["a", "b", "a"]


# ------------------------------------------------------------------ README


def _readme_names() -> tuple[set[str], set[str]]:
    """Paths (``recaccel/...``, ``tests/...``) and dotted ``recaccel.`` names README.md gives."""
    text = (REPO / "README.md").read_text()
    paths = set(re.findall(r"(?<![\w./-])((?:recaccel|tests)/[\w/.-]*\w/?)", text))
    dotted = set(re.findall(r"(?<![\w./-])(recaccel(?:\.\w+)+)", text)) - README_NOT_MODULES
    return paths, dotted


def test_readme_names_existing_modules():
    paths, dotted = _readme_names()
    found = [
        f"README.md names {path}, which does not exist"
        for path in sorted(paths)
        if not (REPO / path).exists()
    ]
    for name in sorted(dotted):
        parts = name.split(".")
        known = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules())
        module, rest = ".".join(parts[:known]), parts[known:]
        if len(rest) > 1:
            found.append(f"README.md names {name}: {'.'.join(parts[: known + 1])} is no module")
        elif rest and (why := resolve(module, rest[0])):
            found.append(f"README.md names {name}: {why}")
    assert_none(found, "every module path and dotted recaccel name in README.md exists")


def test_bench_registry_names_existing_modules():
    # The registry imports benchmarks by name, lazily: a moved module would only fail when run.
    path = modules()["recaccel.bench.harness.registry"]
    named = [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and within(node.value, "recaccel")
    ]
    assert named, f"{path.relative_to(REPO)} names no benchmark module"
    missing = [
        f"{path.relative_to(REPO)} names {name}, which is no module"
        for name in named
        if name not in modules()
    ]
    assert_none(missing, "every benchmark module the registry names exists")


# ------------------------------------------------------------------ sizes

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
# Converters read one file format top to bottom: a long function there reads better whole.
LONG_FUNCTIONS_ALLOWED_IN = ("recaccel/io/convert/",)
# train/ and bench/ are being reorganised; remove entries as they are split. The tests
# fail on an entry that no longer exists or has shrunk under the limit: the lists only shrink.
LONG_FILES_BEING_SPLIT: frozenset[str] = frozenset()
LONG_FUNCTIONS_BEING_SPLIT: frozenset[str] = frozenset()


def source_files() -> dict[str, Path]:
    """Every Python file of recaccel by repository-relative path."""
    return {str(path.relative_to(REPO)): path for path in modules().values()}


def file_lengths() -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in source_files().items()}


def function_lengths(tree: ast.AST, name: str) -> dict[str, int]:
    """``file:function`` -> lines (``file:Class.method`` for methods; nested functions
    count in their parent, decorators not)."""
    found = {}
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found[f"{name}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
            elif isinstance(child, ast.ClassDef):
                stack.append((child, f"{prefix}{child.name}."))
            else:
                stack.append((child, prefix))
    return found


def all_function_lengths() -> dict[str, int]:
    found = {}
    for name, path in source_files().items():
        found.update(function_lengths(ast.parse(path.read_text()), name))
    return found


def check_shrinking(lengths: dict[str, int], limit: int, allowed: frozenset[str], what: str) -> list[str]:
    """Offenders over ``limit`` outside ``allowed``, and entries of ``allowed`` that are gone
    or no longer over it."""
    found = [
        f"{name}: {length} lines (at most {limit}: split it by job)"
        for name, length in sorted(lengths.items())
        if length > limit and name not in allowed
    ]
    found += [
        f"{name} is allow-listed but {'is gone' if name not in lengths else f'has {lengths[name]} lines'}: "
        f"remove it from {what}"
        for name in sorted(allowed)
        if lengths.get(name, 0) <= limit
    ]
    return found


def test_no_file_over_500_lines():
    found = check_shrinking(file_lengths(), MAX_FILE_LINES, LONG_FILES_BEING_SPLIT, "LONG_FILES_BEING_SPLIT")
    assert_none(found, f"no file of recaccel over {MAX_FILE_LINES} lines")


def test_no_function_over_80_lines_outside_converters():
    lengths = {
        name: length
        for name, length in all_function_lengths().items()
        if not name.startswith(LONG_FUNCTIONS_ALLOWED_IN)
    }
    found = check_shrinking(
        lengths, MAX_FUNCTION_LINES, LONG_FUNCTIONS_BEING_SPLIT, "LONG_FUNCTIONS_BEING_SPLIT"
    )
    assert_none(found, f"no function of recaccel over {MAX_FUNCTION_LINES} lines outside io/convert/")


def test_size_checks_see_methods_and_shrunk_entries():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert function_lengths(tree, "x.py") == {"x.py:A.f": 4}
    lengths = {"a.py": 600, "b.py": 10, "c.py": 501}
    assert check_shrinking(lengths, 500, frozenset({"b.py", "c.py", "d.py"}), "L") == [
        "a.py: 600 lines (at most 500: split it by job)",
        "b.py is allow-listed but has 10 lines: remove it from L",
        "d.py is allow-listed but is gone: remove it from L",
    ]


# ------------------------------------------------------------------ tests/

TESTS = REPO / "tests"


def _is_test_file(module: str) -> bool:
    return module.startswith("test_") or module == "conftest"


def foreign_test_imports(source: str, where: str) -> list[str]:
    """Imports of another test file (a test module or a conftest) in ``source``: shared
    helpers live in tests/helpers/, shared fixtures in conftest.py files, which pytest finds."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            names = [f"{'.' * node.level}{node.module or ''}"]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [
            f"{where}:{node.lineno}: imports {name}"
            for name in names
            if name.startswith(".") or (within(name, "tests") and _is_test_file(name.rpartition(".")[2]))
        ]
    return found


def test_test_files_share_code_through_helpers_and_conftest_only():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += foreign_test_imports(path.read_text(), str(path.relative_to(REPO)))
    assert_none(found, "test files import no other test module or conftest (tests/helpers/ instead)")


def test_train_tests_mirror_the_train_packages():
    train = REPO / "recaccel" / "train"
    packages = {p.name for p in train.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in (TESTS / "train").iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders == packages, (
        f"tests/train/ folders {sorted(folders)} != recaccel/train/ packages {sorted(packages)}"
    )


def test_test_import_check_sees_a_test_module_and_a_conftest_but_lets_a_model_module_pass():
    source = "from tests.helpers.dlrm_run import TINY\nfrom tests.train.loop.test_trainer import x\n"
    source += "import tests.ops.conftest\nfrom .test_tasks import cfg\n"
    source += "from tests.train.model.class_path_models import ConcatMLP\n"  # a model the test names
    assert foreign_test_imports(source, "t.py") == [
        "t.py:2: imports tests.train.loop.test_trainer",
        "t.py:3: imports tests.ops.conftest",
        "t.py:4: imports .test_tasks",
    ]
