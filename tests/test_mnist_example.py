"""examples/mnist.py's flags: what the banner and the summary say, the outer update."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mnist.py"


def load_example():
    spec = importlib.util.spec_from_file_location("mnist_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_outer_nesterov_defaults_and_the_label_of_the_run() -> None:
    example = load_example()
    args = example.parse_args(["--sync-every", "8", "--outer", "nesterov"])
    assert example.overlap_args(args, None) == {
        "sync_every": 8, "outer": {"optimizer": "nesterov", "lr": 1.0, "momentum": 0.5}}
    assert example.overlap_label(args) == \
        "staleness 0, sync every 8 step(s), outer nesterov:1.0:0.5"
    args = example.parse_args(["--sync-every", "8", "--outer", "nesterov",
                               "--outer-lr", "0.7", "--outer-momentum", "0.9"])
    assert example.overlap_args(args, None)["outer"] == \
        {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.9}
    assert example.overlap_label(example.parse_args(["--staleness", "1"])) == \
        "staleness 1, sync every 1 step(s)"
    assert example.overlap_label(example.parse_args(["--sync-every", "4"])) == \
        "staleness 0, sync every 4 step(s), outer average"
