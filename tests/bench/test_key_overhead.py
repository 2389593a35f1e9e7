"""bench/key_overhead.py end to end on a tiny model: the jobs run, the table counts the
pushes a step makes (small tensors fused into one bucket) and the worker's threads."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness import paths


def test_a_step_pushes_the_weights_and_one_bucket_of_biases(tmp_path):
    # 4 x Linear(128, 128): each weight (64 KiB) is compressed, and the four biases
    # (128 floats each, 256 KiB of weights between the first and the last) share a
    # bucket of the 4 MB default partition: 5 pushes a step
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(paths.BENCH / "key_overhead.py"), "--layers",
                           "4", "--width", "128", "--steps", "4", "--warmup", "1",
                           "--rounds", "1", "--only", "host", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=paths.ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["pushes"] for r in results["host"]] == [5.0]
    assert [r["pushes"] for r in results["alone"]] == [0.0]
    assert "MainThread" in results["host"][0]["threads_s"], results["host"]
    assert "| host |" in done.stdout and "| alone |" in done.stdout


def test_convoy_times_each_call_alone_and_beside_a_busy_thread():
    done = subprocess.run([sys.executable, str(paths.BENCH / "key_overhead.py"), "--convoy"],
                          capture_output=True, text=True, timeout=120, cwd=paths.ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| Tensor.")]
    assert len(rows) == 5 and all(len(row.split("|")) == 5 for row in rows), done.stdout
    for row in ("| onebit + EF + Nesterov: compress, decompress", "| zmq: ZMQ_EVENTS",
                "| zmq: a receive with nothing waiting"):
        assert any(line.startswith(row) for line in done.stdout.splitlines()), done.stdout


def test_only_takes_a_configuration_whose_name_has_a_comma():
    # every name before the unknown one is taken (a comma-separated piece that is not a
    # configuration would be named instead), with or without a space after the comma
    done = subprocess.run([sys.executable, str(paths.BENCH / "key_overhead.py"), "--only",
                           "alone,host, node agent,device path,node agent,nope"],
                          capture_output=True, text=True, timeout=120, cwd=paths.ROOT)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--only: unknown configuration 'nope'" in done.stderr, done.stderr


def test_neighbour_times_the_model_beside_each_neighbour_and_stops_them():
    import os

    import pytest

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--neighbour needs two cores")
    done = subprocess.run([sys.executable, str(paths.BENCH / "key_overhead.py"), "--neighbour",
                           "--layers", "4", "--width", "64", "--steps", "5", "--warmup", "1"],
                          capture_output=True, text=True, timeout=120, cwd=paths.ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith(("| alone", "| beside"))]
    assert [row[0].strip() for row in rows] == [
        "alone", "beside a process spinning in registers", "beside a process streaming memory"]
    assert rows[0][2].strip() == "1.00" and all(float(row[1]) > 0 for row in rows), rows
    assert not [pid for pid in os.listdir("/proc")  # no neighbour outlives the bench
                if pid.isdigit() and b"np.add(a, 1.0" in _cmdline(pid)]


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # ended meanwhile
        return b""
