"""The import layers, read from the package's folders.

Each subpackage of ``bps`` is a layer, and the modules at the top of ``bps/`` (the public
API and the front ends) are the top layer. A module may import its own layer and the
layers listed below it in ``BELOW``, never a layer above it or a sibling. Every import
statement counts: at module level, inside functions and under ``TYPE_CHECKING``. There is
no import cycle anywhere, inside a layer included.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

# the layers each layer may import, by folder; a new subpackage must be placed here
BELOW = {
    "bps.common": set(),
    "bps.compressors": {"bps.common"},
    "bps.worker": {"bps.common", "bps.compressors"},
    "bps.server": {"bps.common", "bps.compressors"},
    "bps.launch": {"bps.common", "bps.compressors", "bps.server"},
    "bps.core": {"bps.common", "bps.compressors", "bps.worker", "bps.server", "bps.launch"},
    "bps.modes": {"bps.common", "bps.compressors", "bps.worker", "bps.server", "bps.launch",
                  "bps.core"},
    "bps": {"bps.common", "bps.compressors", "bps.worker", "bps.server", "bps.launch",
            "bps.core", "bps.modes"},
}


def subpackage_folders(package: str) -> dict[str, Path]:
    """The subpackages of ``package`` by name, with their folders: those inside its folder,
    and in a source checkout those that pyproject.toml maps onto it from the repository's
    root (``compressors/`` is ``bps.compressors``), found by asking the import system."""
    spec = importlib.util.find_spec(package)
    folders = {}
    for location in spec.submodule_search_locations:
        candidates = [Path(location)]
        if package == "bps":
            candidates.append(Path(location).parent)
        for folder in candidates:
            for info in pkgutil.iter_modules([str(folder)]):
                name = f"{package}.{info.name}"
                if not info.ispkg or name in folders:
                    continue
                found = importlib.util.find_spec(name) if folder == Path(location) \
                    else _spec_or_none(name)
                if found and Path(found.origin).parent == folder / info.name:
                    folders[name] = folder / info.name
    return folders


def _spec_or_none(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def package_files(package: str = "bps") -> dict[str, Path]:
    """Every module of ``package`` and its subpackages, by dotted name, with its file."""
    spec = importlib.util.find_spec(package)
    files = {package: Path(spec.origin)}
    for location in spec.submodule_search_locations:
        for info in pkgutil.iter_modules([location]):
            if not info.ispkg and info.name != "__main__":
                files[f"{package}.{info.name}"] = Path(location) / f"{info.name}.py"
    for name in subpackage_folders(package):
        files.update(package_files(name))
    return files


MODULES = package_files()


def layer_of(module: str) -> str:
    """The subpackage a module lives in; ``bps`` for the modules at the top."""
    return next((layer for layer in BELOW if layer != "bps" and
                 (module == layer or module.startswith(layer + "."))), "bps")


def imports_of(module: str) -> set[str]:
    """The ``bps`` modules that ``module`` imports anywhere in its source."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
                          else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_subpackage_is_a_layer() -> None:
    packages = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert sorted(packages - set(BELOW)) == []


@pytest.mark.parametrize("layer", list(BELOW))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    allowed = BELOW[layer] | {layer}
    violations = [f"{module} imports {target} ({layer_of(target)} layer)"
                  for module, targets in GRAPH.items() if layer_of(module) == layer
                  for target in sorted(targets) if layer_of(target) not in allowed]
    assert violations == [], "\n".join(violations)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm).

        >>> import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
        [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_cycles() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert import_cycles(GRAPH) == []


def test_the_layers_cover_the_front_ends() -> None:
    assert {"bps.trainer", "bps.ddp", "bps"} <= {m for m in MODULES if layer_of(m) == "bps"}


IMPORT_EACH = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "bps" or m.startswith("bps."))))
"""


def test_the_roles_below_the_front_ends_load_none_of_them() -> None:
    """``bps/__init__`` loads the front ends lazily: a server, which imports ``bps.common``
    and ``bps.server``, never loads the trainer, the hook or the runtime."""
    below = [m for m in MODULES if layer_of(m) != "bps"]
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, *below],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert [m for m in loaded if layer_of(m) == "bps" and m != "bps"] == []


def test_the_distribution_ships_every_subpackage() -> None:
    """pyproject.toml names the packages by hand (the folders map onto bps.*): a folder it
    misses would be absent from the wheel, though present in a source checkout."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    shipped = set(tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"])
    assert shipped == {m for m, path in MODULES.items() if path.name == "__init__.py"}


def private_reads(source: str) -> list[str]:
    """``x._name`` in ``source`` where ``x`` is neither ``self``, ``cls``, ``super()`` nor
    an imported module (``os._exit``): one object reading another's private attribute."""
    tree = ast.parse(source)
    modules = {alias.asname or alias.name for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in {"self", "cls"} | modules:
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_reads_are_found() -> None:
    source = ("import os\nx = trainer._pipe\ny = self._own + self.pipe._rt\n"
              "os._exit(super()._size())\n")
    assert private_reads(source) == ["2: trainer._pipe", "3: self.pipe._rt"]


def test_no_module_reads_another_objects_private_attributes() -> None:
    assert [f"{module}:{read}" for module, path in MODULES.items()
            for read in private_reads(path.read_text())] == []


@pytest.mark.parametrize("folder", ["compressors", "worker"])
def test_a_folder_with_cached_kernels_refuses_its_top_level_name(folder: str) -> None:
    """From the repository's root ``compressors`` and ``worker`` are importable as
    top-level packages (``pytest --doctest-modules compressors/`` does it); numba would
    then cache their kernels under a module name no job imports, and every later process
    would fail to load them. They refuse, naming the import to use."""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=root,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"ImportError: import bps.{folder}, not '{folder}'" in result.stderr, result.stderr
    ok = subprocess.run([sys.executable, "-c", f"import bps.{folder}"], cwd=root,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
