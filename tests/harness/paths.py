"""The repository's folders, wherever the tests run from (a checkout, or the copy of
tests/, bench/ and examples/ that bench/gpu_host.sh makes), and loading a script that
is no importable module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
EXAMPLES = ROOT / "examples"
DATA = ROOT / "tests" / "data"  # small saved records (tests/data/README.md)
HARNESS = Path(__file__).resolve().parent


def load_file(name: str, path: Path, register: bool = False) -> ModuleType:
    """The module in ``path`` (a bench or example script), imported under ``name``;
    ``register``: kept in ``sys.modules`` under that name first, for a module whose
    dataclasses or pickles look it up there."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
