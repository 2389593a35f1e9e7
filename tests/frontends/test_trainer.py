"""DistributedTrainer end to end: real clusters started with ``bpslaunch local``, running
the toy job of tests/harness/trainer_job.py, whose gradient is known in closed form, so
that every result is compared with the numpy replay of the whole pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bps.compressors import description
from tests.harness.trainer_job import (
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    SIM_LRS,
    initial_params,
    launch,
    load_params,
    load_reports,
    simulate,
    targets,
)

# where the chains run: numba on the host; torch kernels and the staging of the device
# path forced onto CPU tensors; a CUDA model (two nodes sharing the GPU)
PATHS = [
    pytest.param({}, id="host"),
    pytest.param({"env": {"BPS_DEVICE_KERNELS": "1"}}, id="device-forced"),
    pytest.param({"cfg": {"device": "cuda"}}, id="cuda", marks=pytest.mark.cuda),
]


# 100 float32 elements per bucket (BYTEPS_PARTITION_BYTES=400): in backward order e, d
# and c fill one bucket exactly (30 + 30 + 40), b would overflow it and starts the next
# with a; so a step pushes big's 3 partitions and 2 buckets. Offsets that mixed up
# tensors, or a bucket past its capacity, change the parameters or the count.
BUCKET_SHAPES = {"big": (30, 10), "a": (40,), "b": (40,), "c": (40,), "d": (30,), "e": (30,)}
COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
BUCKETS = {"tag": "buckets", "params": {**SIM_CASES["onebit"], **COMMON},
           "shapes": BUCKET_SHAPES, "pushes_per_step": 5}


def assert_simulated(final: np.ndarray, expected: np.ndarray, path: dict, params: dict,
                     err_msg: str) -> None:
    """``final`` is the simulation's ``expected`` bit for bit; except that on a GPU, a
    ``"scale_ulp"`` compressor's scale (onebit's float64 sum of |x|) is added in another
    order, so it may round 1 float32 ulp apart (docs/compression.md)."""
    ulp_scale = description(params["compressor"]).tolerance == "scale_ulp"
    if "device" in path.get("cfg", {}) and ulp_scale:
        np.testing.assert_allclose(final, expected, rtol=1e-5, atol=1e-6, err_msg=err_msg)
    else:
        np.testing.assert_array_equal(final, expected, err_msg=err_msg)


@pytest.fixture(scope="module", params=PATHS)
def simulated(request, tmp_path_factory) -> tuple[Path, list[dict], dict]:
    """One launch per path (3 nodes, 2 servers) of every compressor's run, then the
    bucket-capacity run (last: the keys of the runs before keep their numbers)."""
    path, tmp_path = request.param, tmp_path_factory.mktemp("simulated")
    runs = [{"tag": name, "params": {**case, **COMMON}, "compressed_from": 0}
            for name, case in SIM_CASES.items()]
    runs += [  # warmup: raw for 2 steps; topk k=0.6 would not shrink the payload: raw
        {"tag": "warmup", "params": {**SIM_CASES["onebit"], **COMMON, "warmup_steps": 2},
         "compressed_from": 2},
        {"tag": "dense", "params": {"compressor": "topk", "k": 0.6, **COMMON},
         "compressed_from": None},
    ]
    # 3 nodes: the servers' float32 sums of 3 terms round as the simulation's only
    # because they add the pushes in node order, whichever arrives first. 4 pushes per
    # step: 3 partitions of big, and small and bias fused
    result = launch({"runs": [*runs, BUCKETS], "lrs": SIM_LRS, "stop": len(SIM_LRS),
                     "pushes_per_step": 4, **path.get("cfg", {})}, tmp_path, workers=3,
                    servers=2, env=path.get("env"))
    assert result.returncode == 0, result.stdout[-3000:]
    return tmp_path, runs, path


def test_every_compressor_matches_independent_simulation(simulated):
    tmp_path, runs, path = simulated
    reports = load_reports(tmp_path, 3)[0]
    for run in runs:
        name = run["tag"]
        finals = load_params(tmp_path, 3, name)
        for rank in (1, 2):
            for n in SHAPES:
                np.testing.assert_array_equal(finals[rank][n], finals[0][n], err_msg=name)
        expected = simulate(run["params"], 3, SIM_LRS, run["compressed_from"])
        for n in SHAPES:
            assert_simulated(finals[0][n], expected[n], path, run["params"], f"{name}: {n}")
        report = reports[name]
        assert report["optimizer_momentum"] == 0.0 and report["counter"] == 1
        assert [s["pushes"] for s in report["steps"]] == [4] * len(SIM_LRS), name
        ratios = [s["compression_ratio"] for s in report["steps"]]
        if run["compressed_from"] is None:
            assert max(ratios) < 1.01, (name, ratios)
        else:
            assert max(ratios[:run["compressed_from"]], default=0) < 1.01, (name, ratios)
            assert min(ratios[run["compressed_from"]:]) > 1.5, (name, ratios)


def test_small_tensors_beyond_one_bucket_split_at_its_capacity(simulated):
    tmp_path, _, path = simulated
    finals = load_params(tmp_path, 3, BUCKETS["tag"])
    expected = simulate(BUCKETS["params"], 3, SIM_LRS, shapes=BUCKET_SHAPES)
    for n in BUCKET_SHAPES:
        assert_simulated(finals[0][n], expected[n], path, BUCKETS["params"], n)
        np.testing.assert_array_equal(finals[2][n], finals[0][n], err_msg=n)
    steps = load_reports(tmp_path, 3)[0][BUCKETS["tag"]]["steps"]
    assert [s["pushes"] for s in steps] == [5] * len(SIM_LRS)


# test_comm_dtype_rounds_exactly_where_the_pipeline_does covers it bit for bit (2 nodes x
# 2 local ranks, fp16 and bf16, rank 0's buffers, momentum moved, bytes on the wire)
@pytest.mark.slow
def test_fp16_two_local_ranks_per_node(tmp_path):
    shapes = {"big": (60, 50), "small": (7,), "bias": (4,)}  # small and bias: fused
    lrs = [0.1, 0.1, 0.05, 0.05]
    params = {"momentum": "nesterov", "fp16": True}
    result = launch({"runs": [{"params": params}], "lrs": lrs, "stop": len(lrs),
                     "shapes": shapes},
                    tmp_path, workers=2, servers=2, local_size=2,
                    env={"BYTEPS_PARTITION_BYTES": "4000"})
    assert result.returncode == 0, result.stdout[-3000:]
    finals = load_params(tmp_path, 4)
    for other in finals[1:]:
        for name in shapes:
            np.testing.assert_array_equal(other[name], finals[0][name])
    # Exact averaged SGD with local Nesterov momentum, in float64: fp16 only rounds.
    w = {n: v.astype(np.float64) for n, v in initial_params(0, shapes).items()}
    m = {n: np.zeros(shapes[n]) for n in shapes}
    goals = [targets(r, shapes) for r in range(4)]
    for lr in lrs:
        for n in shapes:
            g = np.mean([w[n] - goals[r][n] for r in range(4)], axis=0)
            m[n] = g + MOMENTUM * m[n]
            w[n] = w[n] - lr * (g + MOMENTUM * m[n])
    for n in shapes:
        np.testing.assert_allclose(finals[0][n], w[n], atol=2e-2, rtol=1e-2)
        assert not np.array_equal(finals[0][n], w[n].astype(np.float32))  # fp16 did round
    report = load_reports(tmp_path, 4)[0][""]
    assert report["counter"] == 1  # rank 0's buffer everywhere
    assert report["optimizer_momentum"] == 0.0  # moved into bps
    raw = sum(int(np.prod(s)) * 4 for s in shapes.values())
    assert report["steps"][-1]["raw_bytes"] == raw
    assert 0 < report["steps"][-1]["bytes_pushed"] < 0.6 * raw  # fp16 on the wire


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_two_gpus_per_node_reduce_and_broadcast_on_streams_of_their_own(tmp_path):
    # NCCL orders a collective after its caller's stream: the reduce and broadcast
    # threads' collectives on one shared stream, queued in another order on each local
    # rank, waited for each other across ranks (a hang). Many keys, several steps.
    shapes = {f"w{i}": (40, 10) for i in range(12)}
    lrs = [0.1] * 6
    params = {"compressor": "onebit", "scaling": True, "ef": "vanilla", "fp16": False}
    result = launch({"runs": [{"params": params}], "lrs": lrs, "stop": len(lrs),
                     "shapes": shapes, "device": "cuda-local"},
                    tmp_path, workers=2, servers=1, local_size=2, timeout=240,
                    env={"BYTEPS_PARTITION_BYTES": "800"})
    assert result.returncode == 0, result.stdout[-3000:]
    finals = load_params(tmp_path, 4)
    for other in finals[1:]:
        for name in shapes:
            np.testing.assert_array_equal(other[name], finals[0][name])


# tests/modes/test_periodic.py's test_overlap_modes_match_simulation_and_resume_exactly
# resumes the same chain (randomk with error feedback and Nesterov) in the synchronous
# trainer, with the other modes' runs, from fresh processes and another job seed
@pytest.mark.slow
def test_resume_from_state_dict_continues_exactly(tmp_path):
    # randomk: worker and server chains carry error, momentum and RNG state
    params = {"compressor": "randomk", "k": 0.1, "ef": "vanilla", "momentum": "nesterov",
              "fp16": False, "min_compress_bytes": 1000}
    lrs = [0.2, 0.2, 0.1, 0.1, 0.05, 0.05]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    # Uninterrupted 6 steps; a checkpoint is taken after step 3 (and must not disturb).
    run = launch({"runs": [{"params": params}], "lrs": lrs, "stop": 6, "save_at": 3},
                 whole, servers=2)
    assert run.returncode == 0, run.stdout[-3000:]
    for r in range(2):
        (resumed / f"ckpt{r}.pt").write_bytes((whole / f"ckpt{r}.pt").read_bytes())
    # Fresh processes, a different job seed: the RNG state must come from the checkpoint.
    run = launch({"runs": [{"params": params}], "lrs": lrs, "start": 3, "stop": 6}, resumed,
                 servers=2, env={"BPS_JOB_SEED": "999"})
    assert run.returncode == 0, run.stdout[-3000:]
    for r in range(2):
        for name in SHAPES:
            np.testing.assert_array_equal(load_params(resumed, 2)[r][name],
                                          load_params(whole, 2)[r][name])
    assert not np.array_equal(load_params(whole, 2)[0]["big"], initial_params(0, SHAPES)["big"])


def test_bad_input_fails_in_constructor_on_every_rank(tmp_path):
    bad = [({"compressor": "topk"}, "'k'"),
           ({"compressor": "onebit", "fp16": "yes"}, "'fp16'"),
           ({"compressor": "onebit", "colour": 1}, "'colour'"),
           ({"momentum": "nesterov", "mu": 1.5}, "'mu'")]
    start = time.monotonic()
    result = launch({"bad_params": [b for b, _ in bad]}, tmp_path)
    assert result.returncode != 0  # every rank exits 3 after the shutdown barrier
    for r in range(2):
        *errors, mismatch = json.loads((tmp_path / f"errors{r}.json").read_text())
        assert len(errors) == len(bad)
        for message, (_, key) in zip(errors, bad, strict=True):
            assert key in message, message
        # rank 1's model has 'big' of shape (31, 10): both ranks name it
        assert "ModelMismatchError" in mismatch and "'big'" in mismatch, mismatch
        assert "rank 1" in mismatch and "(30, 10)" in mismatch
    assert "(31, 10)" in (tmp_path / "errors1.json").read_text()
    assert time.monotonic() - start < 90


def test_init_without_launcher_names_the_variable():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    result = subprocess.run([sys.executable, "-c", "import bps; bps.init()"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DMLC_ROLE" in result.stderr and "bpslaunch" in result.stderr


def test_dir_lists_the_names_loaded_lazily():
    """``dir(bps)`` shows the public names, also those loaded on first use, without
    loading them."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys, bps; print(sorted(dir(bps))); "
                               "print('bps.trainer' in sys.modules, 'bps.ddp' in sys.modules)"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    names, loaded = result.stdout.splitlines()
    for name in ("init", "shutdown", "rank", "size", "local_rank", "local_size",
                 "DistributedTrainer", "NonFiniteGradientError", "ElasticSampler", "ddp"):
        assert repr(name) in names, names
    assert loaded == "False False", loaded
