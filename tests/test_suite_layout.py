"""The test suite's own rules, read from the source of tests/ (AST):

- no module of tests/ imports a test module: what tests share lives in tests/harness/
  (and tests/conftest.py's fixtures), so a test module can move or change alone;
- nothing changes ``sys.path``, not even a script that a test hands to a subprocess:
  tests/ is the package ``tests`` and its programs run as modules
  (``python -m tests.harness.trainer_job``) or by path without importing ``tests``;
- every folder of tests/ that holds Python files is a package, so that each test module
  has one dotted name (``tests.server.test_rules``), whatever its folder holds;
- tests mirror the source: ``tests/<folder>/test_<module>.py`` (or
  ``test_<module>_<topic>.py``) tests ``<module>`` of the source folder that
  :data:`MIRRORS` pairs with ``<folder>``, so the tests of a module are found by its name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# a folder of tests/ -> the source folder whose modules its test modules test
MIRRORS = {
    "common": "bps/common", "core": "bps/core", "modes": "bps/modes", "frontends": "bps",
    "compressors": "compressors", "server": "server", "worker": "worker", "launch": "launch",
    "bench": "bench", "examples": "examples",
}


def module_name(path: Path) -> str:
    """``tests/server/test_rules.py`` -> ``tests.server.test_rules``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_test_module(path: Path) -> bool:
    """What pytest collects by default: ``test_*.py`` and ``*_test.py``."""
    return path.name.startswith("test_") or path.name.endswith("_test.py")


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of everything ``tree`` imports anywhere; for ``from a import
    b`` both ``a`` and ``a.b`` (b may be a module), relative imports resolved against
    ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def changes_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change ``sys.path``: a call of one of its methods (insert, append,
    extend...), an assignment to it or to an item or slice of it, ``+=``, and
    ``site.addsitedir``."""
    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value) or (
                    node.func.attr == "addsitedir" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "site"):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if is_sys_path(target) or (isinstance(target, ast.Subscript)
                                           and is_sys_path(target.value)):
                    lines.append(node.lineno)
    return lines


def scripts_in_strings(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """The string constants that are Python programs mentioning ``sys.path`` (a script a
    test runs with ``python -c``), parsed."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and "sys.path" in node.value:
            try:
                found.append((node.lineno, ast.parse(node.value)))
            except SyntaxError:
                continue
    return found


def violations(source: str, path: Path, test_modules: set[str], scripts: bool = True
               ) -> list[str]:
    """Every broken rule of one file of tests/, as ``path:line: what``; ``scripts``: the
    programs in its strings count too."""
    tree = ast.parse(source, filename=str(path))
    module = module_name(path)
    where = path.relative_to(ROOT)
    found = [f"{where}:{line}: imports the test module {name}"
             for line, name in imported_modules(tree, module, path.name == "__init__.py")
             if name in test_modules and name != module]
    found += [f"{where}:{line}: changes sys.path" for line in changes_sys_path(tree)]
    if scripts:
        found += [f"{where}:{line}: a script in a string changes sys.path"
                  for line, script in scripts_in_strings(tree) if changes_sys_path(script)]
    return found


TEST_MODULES = {module_name(p) for p in python_files() if is_test_module(p)}


def test_no_module_imports_a_test_module_or_changes_sys_path() -> None:
    own = Path(__file__).resolve()
    found = []
    for path in python_files():
        # this module's examples below are strings that break the rules on purpose
        found += violations(path.read_text(), path, TEST_MODULES, scripts=path != own)
    assert found == [], "\n".join(found)


def test_every_folder_with_python_files_is_a_package() -> None:
    folders = {p.parent for p in python_files()}
    assert sorted(str(f.relative_to(ROOT)) for f in folders
                  if not (f / "__init__.py").is_file()) == []


@pytest.mark.parametrize(("source", "expected"), [
    ("from tests.server.test_rules import push\n", ["imports the test module"]),
    ("from tests.server import test_rules\n", ["imports the test module"]),
    ("import tests.server.test_rules as rules\n", ["imports the test module"]),
    ("from .test_rules import push\n", ["imports the test module"]),
    ("def f():\n    from . import test_rules\n", ["imports the test module"]),
    ("import sys\nsys.path.insert(0, 'x')\n", ["changes sys.path"]),
    ("import sys\nsys.path.append('x')\n", ["changes sys.path"]),
    ("import sys\nsys.path[:0] = ['x']\n", ["changes sys.path"]),
    ("import sys\nsys.path += ['x']\n", ["changes sys.path"]),
    ("import site\nsite.addsitedir('x')\n", ["changes sys.path"]),
    ("SCRIPT = 'import sys\\nsys.path.insert(0, \"bench\")\\nimport slow_network\\n'\n",
     ["a script in a string changes sys.path"]),
    ("from tests.harness.trainer_job import launch\nfrom tests.harness import ps_job\n"
     "import sys\nprint(sys.path)\nSCRIPT = 'print(sys.path)'\n", []),
])
def test_the_rules_find_what_they_forbid(source: str, expected: list[str]) -> None:
    path = TESTS / "server" / "test_example.py"  # a test module beside tests/server/test_rules.py
    found = violations(source, path, {"tests.server.test_rules", "tests.server.test_example"})
    assert [f.split(": ", 1)[1].split(" tests.")[0] for f in found] == expected, found


def unmirrored(test_path: Path, root: Path = ROOT) -> str | None:
    """Why ``test_path`` (a test module under ``root/tests``) breaks the mirror rule, or
    None: its folder pairs with no source folder, or its name with no module there."""
    parts = test_path.relative_to(root / "tests").parts
    if len(parts) == 1:
        return None  # tests/test_*.py: rules about the whole tree
    if len(parts) != 2 or parts[0] not in MIRRORS:
        return f"tests/{'/'.join(parts[:-1])}/ mirrors no source folder (MIRRORS)"
    source = root / MIRRORS[parts[0]]
    name = test_path.stem.removeprefix("test_")
    modules = {p.stem for p in source.glob("*.py") if p.stem != "__init__"}
    if any(name == m or name.startswith(m + "_") for m in modules):
        return None
    return f"names no module of {MIRRORS[parts[0]]}/ (test_<module>[_<topic>].py)"


def test_every_test_module_mirrors_a_source_module() -> None:
    found = [f"{p.relative_to(ROOT)}: {why}" for p in python_files()
             if is_test_module(p) and (why := unmirrored(p)) is not None]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(("test_path", "refused"), [
    ("tests/server/test_aggregator.py", False),
    ("tests/server/test_requests_rules.py", False),
    ("tests/frontends/test_trainer_loops.py", False),
    ("tests/test_layering.py", False),
    ("tests/common/test_ps_units.py", True),        # a module of no source folder's
    ("tests/server/test_agg.py", True),             # a prefix of a name is no name
    ("tests/misc/test_server.py", True),            # a folder that mirrors nothing
])
def test_the_mirror_rule_finds_what_it_forbids(test_path: str, refused: bool) -> None:
    assert (unmirrored(ROOT / test_path) is not None) == refused
