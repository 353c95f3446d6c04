"""Which test files hold GPU tests, and how many, read from their code (no collection).

gpu-check splits the GPU suite over pytest processes by file
(:mod:`~recaccel.bench.gpu_check.pytest_groups`); collecting the whole suite first would
cost its own seconds of the step's budget, so the files are read instead. A test runs
under ``-m gpu`` when the module's ``pytestmark`` holds the mark, a decorator holds it
(``@pytest.mark.gpu``, a module-level alias such as ``gpu = pytest.mark.gpu`` then
``@gpu``), a parametrization marks some of its values
(``pytest.param("cuda", marks=pytest.mark.gpu)``: only those values run), or it takes a
fixture of the module whose parameters are so marked. A file's weight is its number of
GPU test instances: each parametrization given as a literal list (or a module-level name
bound to one) multiplies by its length. Conftest fixtures are not read; a test checks all
of this against pytest's own collection of the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

GPU_MARK = re.compile(r"mark\.gpu\b")
_Function = ast.FunctionDef | ast.AsyncFunctionDef


def gpu_test_files(tests: Path, root: Path) -> list[tuple[str, int]]:
    """Every test file under ``tests`` holding GPU tests, with its number of GPU test
    instances (its weight), as paths relative to ``root``, sorted. A file that does not
    parse weighs 1 (pytest reports it)."""
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if not GPU_MARK.search(text):
            continue
        weight = gpu_tests_in(text)
        if weight:
            found.append((path.relative_to(root).as_posix(), weight))
    return found


def gpu_tests_in(source: str) -> int:
    """The number of test instances of a module that run under ``-m gpu``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return 1
    module = _Module(tree)
    functions = [n for n in ast.walk(tree) if isinstance(n, _Function)]
    fixtures = module.gpu_fixture_params([f for f in functions if not f.name.startswith("test_")])
    return sum(module.gpu_instances(f, fixtures) for f in functions if f.name.startswith("test_"))


class _Module:
    """A test module's GPU marks: its aliases of the mark, whether ``pytestmark`` holds it,
    and its module-level literal lists (for parametrizations that name one)."""

    def __init__(self, tree: ast.Module) -> None:
        self.aliases: set[str] = set()
        self.marked = False
        self.lists: dict[str, ast.List | ast.Tuple | ast.Dict] = {}
        for node in tree.body:
            if not isinstance(node, ast.Assign):
                continue
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if isinstance(node.value, ast.List | ast.Tuple | ast.Dict):
                self.lists.update(dict.fromkeys(names, node.value))
            if self.has_mark(node.value):
                self.marked |= "pytestmark" in names
                self.aliases |= names - {"pytestmark"}

    def has_mark(self, node: ast.AST) -> bool:
        """Whether ``node`` holds a ``<...>.mark.gpu`` attribute or one of the aliases."""
        return any(
            (
                isinstance(n, ast.Attribute)
                and n.attr == "gpu"
                and isinstance(n.value, ast.Attribute)
                and n.value.attr == "mark"
            )
            or (isinstance(n, ast.Name) and n.id in self.aliases)
            for n in ast.walk(node)
        )

    def values(self, node: ast.AST) -> list[ast.AST] | None:
        """The entries of a literal list, of a module-level name bound to a literal list,
        tuple or dict (its keys), or of ``list(NAME)`` / ``tuple(NAME)``; else None (unknown)."""
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") in ("list", "tuple")
            and len(node.args) == 1
        ):
            node = node.args[0]
        if isinstance(node, ast.Name):
            node = self.lists.get(node.id)
        if isinstance(node, ast.Dict):
            return list(node.keys)
        return list(node.elts) if isinstance(node, ast.List | ast.Tuple) else None

    def gpu_fixture_params(self, fixtures: list[_Function]) -> dict[str, int]:
        """Per fixture giving its tests the mark: how many of its parameters are marked
        (a fixture taking such a fixture inherits its count)."""
        counts: dict[str, int] = {}
        for f in fixtures:
            for d in f.decorator_list:
                params = next((k.value for k in getattr(d, "keywords", []) if k.arg == "params"), None)
                entries = None if params is None else self.values(params)
                if entries is not None and any(self.has_mark(e) for e in entries):
                    counts[f.name] = sum(self.has_mark(e) for e in entries)
        grew = True
        while grew:
            grew = False
            for f in fixtures:
                inherited = [counts[a.arg] for a in f.args.args if a.arg in counts]
                if f.name not in counts and inherited:
                    counts[f.name] = max(inherited)
                    grew = True
        return counts

    def gpu_instances(self, test: _Function, fixtures: dict[str, int]) -> int:
        """How many instances of ``test`` run under ``-m gpu`` (0 when none)."""
        marked = self.marked or any(self.has_mark(d) for d in test.decorator_list if not _parametrize(d))
        total, gpu_values = 1, False
        for d in test.decorator_list:
            if not _parametrize(d) or len(d.args) < 2:
                continue
            entries = self.values(d.args[1])
            if entries is None:
                continue
            marked_entries = [e for e in entries if self.has_mark(e)]
            if marked_entries and not marked:
                total *= len(marked_entries)
                gpu_values = True
            else:
                total *= len(entries)
        from_fixtures = [fixtures[a.arg] for a in test.args.args if a.arg in fixtures]
        if marked or gpu_values:
            return total
        if from_fixtures:
            return total * max(from_fixtures)
        return 0


def _parametrize(decorator: ast.AST) -> bool:
    return isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"
