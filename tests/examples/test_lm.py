"""examples/lm.py, the transformer job: its data and model, and short runs on a real
loopback cluster (``bpslaunch local``, 2 worker nodes, 1 server) with compressed Adam,
whose model starts with a ``-inf`` causal-mask buffer."""

from __future__ import annotations

import hashlib
import json
import math
import sys

from tests.harness.paths import EXAMPLES, load_file
from tests.harness.ps_job import BPSLAUNCH, run_command

EXAMPLE = EXAMPLES / "lm.py"
TINY = ["--steps", "6", "--width", "32", "--layers", "1", "--batch-size", "4",
        "--data-bytes", "200000", "--val-windows", "16", "--warmup", "2"]


def load_example():
    """examples/lm.py as a module (it finds mnist_job.py registered under that name)."""
    if "mnist_job" not in sys.modules:
        sys.modules["mnist_job"] = load_file("mnist_job", EXAMPLES / "mnist_job.py")
    return load_file("lm_example", EXAMPLE)


def test_the_text_is_the_stdlibs_sources_split_by_position():
    lm = load_example()
    train, val, digest = lm.load_text(100_000)
    text = lm.stdlib_bytes(100_000)
    assert (len(train), len(val)) == (90_000, 10_000)
    assert bytes(train.tolist()) == text[:90_000]
    assert digest == hashlib.sha256(text).hexdigest()
    assert b"def " in text and b"site-packages" not in text[:200]


def test_the_model_masks_the_future():
    import torch

    lm = load_example()
    model = lm.GPT(32, 1, 16)
    assert torch.isinf(model.mask).sum().item() == 16 * 15 // 2
    x = torch.randint(256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # a different future leaves the past's logits alone
    assert torch.equal(model(x)[0, :10], model(y)[0, :10])


def test_compressed_adam_runs_and_sends_less_after_the_freeze(tmp_path):
    metrics = tmp_path / "metrics.json"
    cmd = [*BPSLAUNCH, "local", "--workers", "2", "--servers", "1", "--", sys.executable,
           str(EXAMPLE), *TINY, "--compressor", "onebit", "--ef", "vanilla", "--no-fp16",
           "--min-compress-bytes", "0", "--freeze-step", "3", "--metrics-json", str(metrics)]
    code, output = run_command(cmd, {"BPS_TIMEOUT": "60"}, timeout=240)
    assert code == 0, output[-3000:]
    report = json.loads(metrics.read_text())
    assert report["compression_params"]["freeze_step"] == 3
    assert math.isfinite(report["val_loss"]) and report["val_loss"] < math.log(256) + 0.5
    sent = [s["bytes"] for s in report["steps"]]
    assert max(sent[3:]) * 20 < min(sent[:3]), sent  # onebit momentum against raw fp32
    assert f"sha256 {report['sha256']}" in output
