"""bench/gpu_step.py end to end with tiny sizes on the CPU (``--device cpu --quick``): a
real 2-node, 2-server cluster, the report's figures checked against the model's size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import paths

# the bench itself runs on a GPU host (bench/gpu_host.sh); here it only has to run
pytestmark = pytest.mark.slow

BENCH = paths.BENCH / "gpu_step.py"


def test_quick_cpu_run_reports_every_selected_configuration(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--quick",
                           "--only", "mlp-fp16,mlp-onebit", "--steps", "2", "--warmup", "1",
                           "--json", str(out), "--timeout", "60", "--cluster-timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["bps"]) == {"mlp-fp16", "mlp-onebit"}
    assert report["cluster_warnings"] == []  # the cluster's warnings are kept: none here
    assert set(report["alone"]) == {"mlp"} and report["alone"]["mlp"] > 0
    # quick MLP: 2 x Linear(128, 128) + Linear(128, 10)
    params = 2 * (128 * 128 + 128) + 128 * 10 + 10
    raw, onebit = report["bps"]["mlp-fp16"], report["bps"]["mlp-onebit"]
    assert raw["parameters"] == onebit["parameters"] == params
    # every gradient in fp16, pushed and pulled (and the trainer's few bytes of its own)
    assert 2 * 2 * params <= raw["bytes_per_step"] <= 1.01 * 2 * 2 * params
    # onebit: the 128 x 128 weights as signs (+ a scale), the rest raw in fp16
    assert onebit["bytes_per_step"] < raw["bytes_per_step"] / 2
    for result in (raw, onebit):
        assert len(result["steps_s"]) == 2 and result["step_s"] > 0
    assert all(isinstance(v, float) or v.startswith("n/a")
               for v in report["device_compress"].values())
    assert report["copy"] == {"pinned": None, "pageable": None}  # no device on the CPU
    assert "| mlp onebit scaled + EF |" in done.stdout and "| mlp alone |" in done.stdout
