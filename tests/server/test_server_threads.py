"""A server's engine threads: whatever their number, and with a large partition's
kernels in chunks on the shared pool, every step's aggregate has the bits one thread
gives; and bench/server_throughput.py runs (real engine threads, real replies)."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bps.common.striping
import bps.server.server
from bps.compressors import threads
from bps.server.server import KEY_COST, MAX_NUMEL, LeastLoaded
from tests.harness.paths import BENCH, ROOT, load_file

bench = load_file("server_throughput", BENCH / "server_throughput.py")

STEPS = 3
NUMEL = 4000


def aggregates(case: str, engines: int, payloads: list[list[bytes]]
               ) -> tuple[list[dict], set]:
    """Every step's aggregate per key from a server with ``engines`` engine threads that
    gets ``payloads`` every step, and the chunk counts of its keys' chains."""
    params, dtype = bench.CASES[case]
    keys, numel = len(payloads[0]), NUMEL
    rig = bench.Rig(engines, keys, numel, dtype, params, partition_bytes=1 << 20)
    try:
        steps = []
        for step in range(STEPS):
            rig.step(step, payloads)
            steps.append({key: b"".join(frame.bytes for frame in frames)
                          for key, frames in rig.aggregates.items()})
        chunks = {len(state.chain.bounds) for engine in rig.engines
                  for state in engine.keys.values() if state.chain is not None}
    finally:
        rig.close()
    return steps, chunks


@pytest.mark.parametrize("case", ["onebit", "topk 1%", "randomk 1%", "fp16 raw"])
def test_engine_threads_and_chunks_give_the_bits_of_one_thread(monkeypatch, case):
    params, dtype = bench.CASES[case]
    keys = 5
    payloads = bench.worker_payloads(params, dtype, keys, NUMEL)
    one, chunks = aggregates(case, 1, payloads)
    assert chunks <= {1}
    monkeypatch.setattr(threads, "MIN_CHUNK", 256)
    monkeypatch.setattr(threads, "THREADS", 4)
    many, chunks = aggregates(case, 3, payloads)
    assert chunks <= {4}
    assert all(len(step) == keys for step in one)
    for step in range(STEPS):
        assert many[step] == one[step], f"step {step}"
    if params is None:  # raw float16: the sum of the two pushes, rounded once
        for key in range(keys):
            first, second = (torch.frombuffer(bytearray(node[key]), dtype=dtype)
                             for node in payloads)
            assert one[-1][key] == (first + second).numpy().tobytes()
    else:  # the server's error feedback carries over: each step compresses another sum
        assert one[0] != one[1]


def test_server_throughput_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    done = subprocess.run(
        [sys.executable, "bench/server_throughput.py", "--threads", "1", "2", "--keys", "2",
         "--steps", "1", "--partition-bytes", "65536", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["case"], r["threads"]) for r in results] == [
        (case, count) for case in bench.CASES for count in (1, 2)]
    assert all(r["gb_per_s"] > 0 and r["server_s"] > 0 for r in results)
    assert "| onebit | 2 |" in done.stdout


def test_new_keys_go_to_the_least_loaded_engine_thread() -> None:
    engines = ["e0", "e1", "e2"]
    pick = LeastLoaded(engines)
    # a layer's weight, then its bias and a norm's weight: round-robin would give every
    # weight to e0
    sizes = [1_000_000, 5, 5] * 6
    owners = [pick({"numel": numel}) for numel in sizes]
    weights = [owner for owner, numel in zip(owners, sizes, strict=True) if numel > 5]
    assert sorted(weights) == sorted(engines * 2)
    assert sum(pick.loads) == sum(sizes) + KEY_COST * len(sizes)
    # greedy least-loaded: no engine ends above another by more than the largest key
    assert max(pick.loads) - min(pick.loads) <= KEY_COST + max(sizes)
    lightest = pick.loads.index(min(pick.loads))
    assert pick({"numel": 2**62}) == engines[lightest]
    assert pick.loads[lightest] <= 2_000_000 + 9 * KEY_COST + MAX_NUMEL  # bogus: MAX_NUMEL
    assert doctest.testmod(bps.server.server).failed == 0
