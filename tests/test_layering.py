"""The import layers: each layer loads nothing of the layers above it, nor of its sibling.

    bottom       bps (lazy), bps.env, bps.protocol, bps.memory, bps.trace, bps.config,
                 bps.ratelimit, bps.auth, bps.scheduler_client, bps.striping
    compressors  bps.compressors.*
    worker       bps.worker.*        server   bps.server.*   (neither loads the other)
    launch       bps.launch.*
    top          bps.runtime, bps.grad_pipeline, bps.trainer, bps.ddp, bps.model_sync,
                 bps.trainer_stats, bps.mnist, bps.periodic, bps.stale, bps.loss_scale

Each layer's modules are imported in a fresh interpreter, one after another, and every
``bps`` module loaded on the way is checked against the layers that layer may use.
"""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys

import pytest

BOTTOM = ["bps", "bps.env", "bps.protocol", "bps.memory", "bps.trace", "bps.config",
          "bps.ratelimit", "bps.auth", "bps.scheduler_client", "bps.striping"]
TOP = ["bps.runtime", "bps.grad_pipeline", "bps.trainer", "bps.ddp", "bps.model_sync",
       "bps.trainer_stats", "bps.mnist", "bps.periodic", "bps.stale",
       "bps.loss_scale"]

IMPORT_EACH = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    before = {m for m in sys.modules if m == "bps" or m.startswith("bps.")}
    importlib.import_module(name)
    loaded[name] = sorted(m for m in sys.modules
                          if (m == "bps" or m.startswith("bps.")) and m not in before)
print(json.dumps(loaded))
"""


def package_modules(package: str) -> list[str]:
    """The package and every module in its folder (``__main__`` runs on import: left out)."""
    folder = importlib.util.find_spec(package).submodule_search_locations
    return [package] + sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(folder)
                              if m.name != "__main__")


LAYERS = {
    "bottom": BOTTOM,
    "compressors": package_modules("bps.compressors"),
    "worker": package_modules("bps.worker"),
    "server": package_modules("bps.server"),
    "launch": package_modules("bps.launch"),
    "top": TOP,
}
# what each layer must not load: the layers above it and its sibling
FORBIDDEN = {
    "bottom": ["compressors", "worker", "server", "launch", "top"],
    "compressors": ["worker", "server", "launch", "top"],
    "worker": ["server", "launch", "top"],
    "server": ["worker", "launch", "top"],
    "launch": ["top"],
    "top": [],
}


def layer_of(module: str) -> str | None:
    return next((layer for layer, names in LAYERS.items() if module in names), None)


def test_every_module_of_bps_has_a_layer() -> None:
    folder = importlib.util.find_spec("bps").submodule_search_locations
    top_level = [f"bps.{m.name}" for m in pkgutil.iter_modules(folder) if not m.ispkg]
    assert sorted(m for m in top_level if layer_of(m) is None) == []


@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer_loads_nothing_above_it(layer: str) -> None:
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, *LAYERS[layer]],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    violations = [f"importing {name} loads {module} ({layer_of(module)} layer)"
                  for name, modules in loaded.items() for module in modules
                  if layer_of(module) in FORBIDDEN[layer]]
    assert violations == [], "\n".join(violations)
    unknown = sorted({m for modules in loaded.values() for m in modules if layer_of(m) is None})
    assert unknown == [], f"modules outside every layer: {unknown}"
