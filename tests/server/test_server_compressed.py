"""Compressed keys through a real cluster: what every worker pulls equals the
independent reference of docs/architecture.md, "worker chain -> decompress each push -> sum ->
server chain (error feedback + compressor) -> decompress", for every compressor with
and without error feedback (tests/harness/reference_compressors.py, plain Python)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from bps.compressors import description
from tests.harness import reference_compressors as ref
from tests.harness.ps_job import (
    JOB,
    STEPS,
    TEST_ENV,
    compressed_keys,
    lr_for,
    run_command,
    tensor_for,
)

WORKERS = 2  # two addends: the float32 sum is exact whatever the arrival order


def reference_chain(params: dict, numel: int, dtype: str) -> ref.RefChain:
    """docs/compression.md's chain from the reference encoders (each instance owns its RNG)."""
    encode, decode = ref.ref_codec(params, numel, dtype)
    return ref.RefChain(encode, decode, numel, dtype, ef=params["ef"] == "vanilla", mu=None)


@pytest.fixture(scope="module")
def compressed_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("compressed")
    code, output = run_command(
        [sys.executable, "-m", "bps.launch.cli", "local", "--workers", str(WORKERS),
         "--servers", "2", "--", sys.executable, JOB, "--out", str(out), "--case", "compressed"],
        TEST_ENV, timeout=180)
    assert code == 0, output
    return [torch.load(out / f"node{n}.pt", weights_only=False) for n in range(WORKERS)]


@pytest.mark.parametrize("index", range(len(compressed_keys())))
def test_pulled_aggregate_matches_reference(compressed_run: list[dict], index: int) -> None:
    key, numel, dtype, params = compressed_keys()[index]
    workers = [reference_chain(params, numel, dtype) for _ in range(WORKERS)]
    server = reference_chain(params, numel, dtype)
    # step STEPS ran after state_dict -> garbage step -> load_state_dict (ps_job.py)
    for step in range(STEPS + 1):
        total = np.zeros(numel, dtype=np.float32)
        for node, chain in enumerate(workers):
            chain.set_lr(lr_for(step))
            x = tensor_for(node, key, step, numel, torch.float32).double().numpy()
            total += chain.decode(chain.compress(x)).astype(np.float32)
        server.set_lr(lr_for(step))
        expected = server.decode(server.compress(total.astype(np.float64)))
        for node, run in enumerate(compressed_run):
            got = run["results"][(key, step)]
            assert got.dtype == torch.float32 and got.shape == (numel,)
            if description(params["compressor"]).tolerance == "exact":  # bit for bit
                np.testing.assert_array_equal(got.numpy(), expected,
                                              err_msg=f"{params} step {step} node {node}")
            else:
                np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6,
                                           err_msg=f"{params} step {step} node {node}")


def test_undecodable_payload_is_refused(compressed_run: list[dict]) -> None:
    replies = compressed_run[0]["probes"]
    assert sorted(replies) == sorted(key for key, *_ in compressed_keys())
    for key, message in replies.items():
        assert f"key {key} ('t{key}'): cannot decode payload" in message, message
    # ... and the aggregates of every key stayed exact (the test above)


def test_aggregate_decoded_into_the_given_tensor(compressed_run: list[dict]) -> None:
    # the values are checked against the reference by test_pulled_aggregate_matches_reference
    for run in compressed_run:
        assert run["in_place"] and all(run["in_place"].values()), run["in_place"]
    message = compressed_run[0]["bad_out"]
    assert "out must be a contiguous CPU tensor" in message and "key 200" in message, message
    assert "key 200 ('t200'): divisor=2.0, but its chain does not divide" in message, message
