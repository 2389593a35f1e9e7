"""Real clusters over loopback (``bpslaunch local``): N workers x M servers, many keys
and partitions, several steps, checked against independent numpy references."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness.ps_job import (
    BPSLAUNCH,
    JOB,
    MISMATCH_KEY,
    ORDER_KEY,
    STEPS,
    TEST_ENV,
    check_raw_aggregates,
    numpy_sum,
    order_values,
    raw_keys,
    run_command,
)


def run_cluster(tmp_path: Path, workers: int, servers: int, case: str,
                **env: str) -> list[dict]:
    code, output = run_command(
        BPSLAUNCH + ["local", "--workers", str(workers), "--servers", str(servers), "--",
                     sys.executable, JOB, "--out", str(tmp_path), "--case", case],
        {**TEST_ENV, **env}, timeout=120)
    assert code == 0, output
    return [torch.load(tmp_path / f"node{n}.pt", weights_only=False) for n in range(workers)]


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    # a send credit of 1: every partition waits for the previous one's ACK; payloads in
    # frames of 8 KiB: a 64 KiB partition travels as 8 frames each way, the other keys as
    # 2 to 5 frames with a shorter last one, 1 frame (under 8 KiB); the aggregates must
    # still be bit-identical to the numpy sums (test_raw_aggregates_match_numpy_sum);
    # each worker node holds 3 connections to each server (keys spread over them), with
    # 2 I/O threads per process
    return run_cluster(tmp_path_factory.mktemp("raw"), workers=3, servers=2, case="raw",
                       BPS_MAX_INFLIGHT="1", BPS_FRAME_BYTES="8192",
                       BPS_CONNECTIONS_PER_SERVER="3", BPS_IO_THREADS="2")


def test_raw_aggregates_match_numpy_sum(raw_run: list[dict]) -> None:
    check_raw_aggregates(raw_run)


# the same job, checked the same way, runs in tests/common/test_auth.py's
# test_fuzzed_frames_from_a_key_holder_change_nothing
@pytest.mark.slow
def test_two_workers_sum_narrow_dtypes_exactly(tmp_path: Path) -> None:
    # two terms are summed in float16/bfloat16 themselves: still exactly the float32 sum
    # rounded once, which is what numpy_sum gives
    check_raw_aggregates(run_cluster(tmp_path, workers=2, servers=1, case="raw"))


def test_pushes_are_summed_in_node_order_whatever_their_arrival(raw_run: list[dict]) -> None:
    order = raw_run[0]["order"]
    workers = len(raw_run)
    expected = numpy_sum([order_values(node) for node in range(workers)])
    arrival = numpy_sum([order_values(node) for node in reversed(range(workers))])
    assert not np.array_equal(expected, arrival)  # the values do tell the orders apart
    assert np.array_equal(order["raw"].numpy(), expected)
    assert np.array_equal(order["topk"].numpy(), expected)


def test_a_held_push_that_cannot_be_decoded_is_refused_after_its_ack(
        raw_run: list[dict]) -> None:
    # node 1's garbage waited (ACK) for node 0; decoded then, it got an ERROR, and the
    # step was summed once node 1 pushed again (test above)
    (first, _), (second, message) = raw_run[1]["order"]["refused"]
    assert (first, second) == ("ACK", "ERROR")
    assert f"key {ORDER_KEY + 1}" in message and "cannot decode payload" in message


def test_pulls_of_a_step_get_the_same_bytes(raw_run: list[dict]) -> None:
    node0 = raw_run[0]
    for key, (first, second) in node0["last"].items():
        assert first == second
        assert first == node0["results"][(key, STEPS - 1)].view(torch.uint8).numpy().tobytes()


def test_only_worker_0_restores_server_state(raw_run: list[dict]) -> None:
    message = raw_run[1]["order"]["set_state"]
    assert "SET_STATE" in message and "only worker 0 restores" in message, message


def test_placement_identical_and_balanced(raw_run: list[dict]) -> None:
    placements = [{key: run["placement"][key] for key, *_ in raw_keys()} for run in raw_run]
    assert all(p == placements[0] for p in placements)
    assert set(placements[0].values()) == {0, 1}
    loads = raw_run[0]["loads"]
    biggest = max(numel * getattr(torch, dt).itemsize for _, numel, dt, _ in raw_keys())
    assert max(loads) - min(loads) <= biggest


def test_keys_are_spread_over_each_servers_connections(raw_run: list[dict]) -> None:
    """BPS_CONNECTIONS_PER_SERVER=3: every worker node uses all 3 connections of each
    server, and puts each key on the same one (requests of a key stay in order)."""
    assert [run["connections"] for run in raw_run] == [3, 3, 3]
    stripes = [{key: run["stripes"][key] for key, *_ in raw_keys()} for run in raw_run]
    assert all(s == stripes[0] for s in stripes)
    for server in (0, 1):
        used = {stripes[0][key] for key, *_ in raw_keys()
                if raw_run[0]["placement"][key] == server}
        assert used == {0, 1, 2}, (server, stripes[0])


@pytest.fixture(scope="module")
def bulk_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2 workers, 1 connection each, a server with 2 I/O threads, CURVE: 4 steps of 48 MB
    each way per worker; the job's output."""
    env = {key: value for key, value in TEST_ENV.items() if key != "BYTEPS_PARTITION_BYTES"}
    code, output = run_command(
        BPSLAUNCH + ["local", "--workers", "2", "--servers", "1", "--", sys.executable, JOB,
                     "--out", str(tmp_path_factory.mktemp("bulk")), "--case", "bulk"],
        {**env, "BPS_INSECURE": "0", "BPS_IO_THREADS": "2",
         "BPS_CONNECTIONS_PER_SERVER": "1"}, timeout=120)
    assert code == 0, output
    return output


def test_each_server_io_thread_encrypts_its_own_connections(bulk_output: str) -> None:
    """Each of the server's 2 threads does a fair share of the cipher work. Left to
    libzmq, connections that arrive together both go to one thread (half of the runs,
    measured), and the other idles; bound per thread, each thread serves one connection."""
    found = re.search(r"ZeroMQ I/O threads' CPU seconds: ([\d.]+), ([\d.]+)", bulk_output)
    assert found, bulk_output
    first, second = float(found[1]), float(found[2])
    assert first + second >= 0.1, bulk_output  # 2 x 4 steps x 48 MB each way went through
    assert min(first, second) >= 0.25 * (first + second), (first, second)


def test_a_server_keeps_its_start_up_objects_out_of_the_collector(bulk_output: str) -> None:
    # torch and numba make some 190,000 objects, which every full collection would walk
    # while the server serves
    found = re.search(r"\[server0\] .*: (\d+) objects from start-up kept out of the garbage "
                      r"collector", bulk_output)
    assert found and int(found[1]) > 100_000, bulk_output[-3000:]


def test_malformed_messages_get_errors_and_server_keeps_serving(raw_run: list[dict]) -> None:
    expected = {
        "random_bytes": "not valid msgpack",
        "empty_header": "not valid msgpack",
        "wrong_version": "protocol version",
        "unknown_op": "field 'op'",
        "missing_field": "field 'step' missing",
        "wrong_type": "field 'key' has type str",
        "unknown_key": "key 987654321: unknown key",
        "wrong_size": "field 'nbytes'=8 but the payload has 12 bytes",
        "wrong_raw_size": "raw payload of 8 bytes, expected 65536",
        "wrong_numel": "push numel 5 differs",
        "wrong_dtype": "push dtype 'float64' differs",
        "bad_node": "as worker 77 on a connection of worker 0",
        "no_payload": "0 payload frames, expected 1",
        "stale_step": "step -5 already completed",
        "bad_dtype_register": "dtype 'int8' not one of",
        "huge_register": "numel=268435456 (1073741824 bytes) is larger than a key may be",
        "as_other_node": "as worker 1 on a connection of worker 0",
        "frames_missing": "3 payload frames, expected 4 (field 'nbytes'=65536 in frames of "
                          "16384 bytes)",
        "frames_extra": "5 payload frames, expected 4",
        "frames_uneven": "payload frame 1 has 8192 bytes, expected 16384",
        "frames_short_last": "field 'nbytes'=65536 but the last payload frame has 8192 bytes",
        "frames_tiny": "payload frames of 1024 bytes, less than 4096",
        "frames_oversize": "field 'nbytes'=8589934592 out of range",
        "frames_on_pull": "PULL: 1 payload frames, expected 0",
        "stranger_push": "belongs to no worker of this job",
        "stranger_pull": "belongs to no worker of this job",
        "stranger_get_state": "belongs to no worker of this job",
        "stranger_register": "belongs to no worker of this job",
    }
    probes = raw_run[0]["probes"]
    assert sorted(probes) == [0, 1]
    for server, replies in probes.items():
        for name, fragment in expected.items():
            assert replies[name].startswith("ERROR: ") and fragment in replies[name], \
                (server, name, replies[name])
    # ... while the aggregates above stayed exact (test_raw_aggregates_match_numpy_sum)


def test_declare_mismatch_names_key_and_both_names(raw_run: list[dict]) -> None:
    message = raw_run[1]["mismatch"]
    assert f"key {MISMATCH_KEY}" in message
    assert "'model.b'" in message and "'model.a'" in message
    assert "numel=11" in message and "numel=10" in message


def test_stats_count_wire_bytes(raw_run: list[dict]) -> None:
    payload = sum(numel * getattr(torch, dt).itemsize for _, numel, dt, _ in raw_keys()) * STEPS
    for run in raw_run:
        stats = run["stats"]
        assert payload < stats["bytes_pushed"] < payload * 1.1
        assert payload < stats["bytes_pulled"] < payload * 1.1
        assert stats["pushes"] == len(raw_keys()) * STEPS
        assert stats["comm_s"] > 0

