"""Unit tests of the runtime's pure parts: environment, wire header, partitioning."""

from __future__ import annotations

import doctest
import itertools
import math
import os
import re
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bps.common.striping
import bps.server.server
from bps.common.env import ClusterEnv, EnvError
from bps.common.protocol import (
    MIN_FRAME_BYTES,
    PROTOCOL_VERSION,
    ClusterError,
    Op,
    ProtocolError,
    check_payload,
    decode,
    encode,
    join_frames,
    payload_frames,
    server_seconds,
)
from bps.common.striping import (
    MAX_CONNECTIONS,
    Stripes,
    affinity_mask,
    core_shares,
    default_connections,
    engine_threads,
    host_cores,
    io_threads,
    pinned_connection,
    server_endpoints,
)
from bps.server.server import KEY_COST, MAX_NUMEL, LeastLoaded
from bps.worker.partition import Placement, partition, plan_servers
from bps.worker.send_queues import SendQueues, send_order

BASE = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "2",
        "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_WORKER_ID": "3"}


def test_env_defaults() -> None:
    env = ClusterEnv.from_environ(BASE)
    assert (env.role, env.num_workers, env.num_servers, env.worker_id) == ("worker", 4, 2, 3)
    assert env.scheduler_address == "tcp://10.0.0.1:9000"
    assert (env.partition_bytes, env.min_compress_bytes) == (4096000, 65536)
    assert (env.timeout, env.heartbeat_interval, env.heartbeat_timeout) == (60.0, 1.0, 10.0)
    assert (env.local_rank, env.local_size, env.node_host) == (0, 1, "127.0.0.1")
    short = ClusterEnv.from_environ({**BASE, "BPS_TIMEOUT": "5", "BYTEPS_LOCAL_SIZE": "2",
                                     "BYTEPS_LOCAL_RANK": "1", "DMLC_NODE_HOST": "10.1.0.7"})
    assert (short.timeout, short.heartbeat_timeout, short.local_rank) == (5.0, 5.0, 1)
    assert short.node_host == "10.1.0.7"
    assert env.frame_bytes == 131072  # CURVE: payloads in frames of 128 KiB
    assert ClusterEnv.from_environ({**BASE, "BPS_INSECURE": "1"}).frame_bytes == 0
    assert env.server_threads is None  # the server follows its host's cores
    assert ClusterEnv.from_environ({**BASE, "BPS_SERVER_THREADS": "3"}).server_threads == 3
    assert (env.connections_per_server, env.io_threads, env.on_one_host) == (None, None, False)
    striped = ClusterEnv.from_environ({**BASE, "BPS_CONNECTIONS_PER_SERVER": "4",
                                       "BPS_IO_THREADS": "auto", "DMLC_PS_ROOT_URI": "127.0.0.1"})
    assert (striped.connections_per_server, striped.io_threads, striped.on_one_host) == \
        (4, None, True)


def test_server_threads_share_the_host_among_its_servers() -> None:
    here = [f"tcp://10.0.0.1:{port}" for port in (5001, 5002, 5003)]
    servers = [*here, "tcp://10.0.0.2:5001"]
    assert engine_threads(16, servers, here[1]) == 5  # 3 servers share 16 cores
    assert engine_threads(16, servers, servers[3]) == 16
    assert engine_threads(2, servers, here[0]) == 1  # never none
    assert engine_threads(1024, servers, servers[3]) == 64  # BPS_SERVER_THREADS' bound
    assert 1 <= host_cores() <= (os.cpu_count() or 1)
    assert doctest.testmod(bps.common.striping).failed == 0


SIGTERM_WHILE_EXITING = """
import atexit, os, signal, types
from bps.server.role import serve, setup_process
setup_process()
def stopped_by_the_launcher():
    os.kill(os.getpid(), signal.SIGTERM)
    print("exit finished", flush=True)
atexit.register(stopped_by_the_launcher)
try:
    serve(types.SimpleNamespace(role="none"))
except ValueError:
    pass
"""


def test_a_role_stopped_while_it_exits_ends_without_a_traceback() -> None:
    """bpslaunch sends SIGTERM to every role when one fails; a server already running its
    exit callbacks finishes them instead of printing a SystemExit traceback."""
    result = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_EXITING],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "exit finished" in result.stdout, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


ROLE_THAT_ENDS = """
import atexit, logging
from bps.server.role import end_process, setup_process
setup_process()
atexit.register(lambda: print("finalized", flush=True))
print("buffered line")  # stdout is a pipe here: block-buffered, not yet written
logging.getLogger("bps.server").info("last log line")
end_process(7)
"""


def test_a_finished_role_keeps_its_output_and_code_but_skips_finalization() -> None:
    """A scheduler or server that has finished flushes what it printed and logged and
    exits with its code, without the interpreter's finalization (atexit included)."""
    result = subprocess.run([sys.executable, "-c", ROLE_THAT_ENDS],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 7, result.stderr
    assert result.stdout == "buffered line\n", result.stdout
    assert "bps.server INFO: last log line" in result.stderr, result.stderr
    assert "finalized" not in result.stdout


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


def test_io_thread_cpu_seconds_counts_the_threads_that_moved_the_bytes() -> None:
    """A context of one I/O thread sends 200 MB over loopback TCP: that thread's CPU
    time shows among the process's ZeroMQ I/O threads, and no thread goes backwards."""
    import zmq

    from bps.common.striping import io_thread_cpu_seconds

    ctx = zmq.Context(io_threads=1)
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)  # its I/O thread starts
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        chunk = b"\0" * 4_000_000
        push.send(b"first")  # the I/O thread names itself once it runs: wait for that
        assert pull.poll(10_000), "no message over loopback within 10 s"
        pull.recv()
        before = io_thread_cpu_seconds()
        for _ in range(50):
            push.send(chunk, copy=False)
            assert pull.poll(10_000), "no message over loopback within 10 s"
            pull.recv(copy=False)
        after = io_thread_cpu_seconds()
        push.close(linger=0)
        pull.close(linger=0)
    finally:
        ctx.term()
    # zero-copy sends may start pyzmq's own garbage-collection context, whose I/O
    # thread comes later in thread-id order: compare the threads there before
    assert len(after) >= len(before) >= 1
    assert all(b <= a for a, b in zip(after, before, strict=False))
    assert sum(after) - sum(before) > 0.0


def test_a_reply_server_time_is_read_only_when_it_is_a_time() -> None:
    assert server_seconds(decode(encode(Op.DATA, rid=1, key=2, step=0, nbytes=0,
                                        server_s=0.125))) == 0.125
    for bad in ({}, {"server_s": "1"}, {"server_s": True}, {"server_s": -1.0},
                {"server_s": math.inf}, {"server_s": math.nan}):
        assert server_seconds(bad) == 0.0, bad


def test_striping_defaults_follow_the_host() -> None:
    # 16 cores, 2 workers + 1 server on one host: the server does half of all the
    # cipher work (both workers' traffic), so it gets half of the cores
    worker, server = core_shares(16, workers=2, servers=1, on_one_host=True)
    assert (worker, server) == (4, 8)
    assert default_connections(worker, servers=1) == 4
    assert (io_threads(worker, connections=4), io_threads(server, connections=8)) == (4, 8)
    # 2 cores: one connection per pair; never a share below 1
    assert core_shares(2, workers=2, servers=1, on_one_host=True) == (1, 1)
    assert default_connections(1, servers=1) == 1
    # a worker on a host of its own (one server beside it), 64 cores: at most 8 per server
    assert core_shares(64, workers=8, servers=4, on_one_host=False, servers_beside=1) == \
        (32, 64)
    assert default_connections(32, servers=4) == MAX_CONNECTIONS
    assert default_connections(16, servers=4) == 4  # cores over servers
    assert io_threads(16, connections=2) == 2  # no thread without a connection to serve


def test_pinned_connections_deal_the_jobs_connections_over_both_sides_threads() -> None:
    # 16 cores, 2 workers x 4 connections, a server with 8 I/O threads (8 endpoints):
    # every server thread gets one connection, every worker thread one per server
    servers, connections, endpoints, threads = 2, 4, 8, 4
    for server in range(servers):
        ends = [pinned_connection(node, server, stripe, connections, endpoints, threads)[0]
                for node in range(2) for stripe in range(connections)]
        assert sorted(ends) == list(range(endpoints))
    for node in range(2):
        mine = [pinned_connection(node, server, stripe, connections, endpoints, threads)[1]
                for server in range(servers) for stripe in range(connections)]
        assert [mine.count(t) for t in range(threads)] == [servers] * threads
    # more connections than endpoints: dealt round them, as evenly as they go
    ends = [pinned_connection(node, 0, 0, 1, 2, 1)[0] for node in range(5)]
    assert [ends.count(e) for e in range(2)] == [3, 2]


def test_a_server_of_64_io_threads_binds_one_endpoint_each() -> None:
    # thread 63's mask is the sign bit of the 64-bit option
    import zmq

    from bps.common.striping import bind_per_io_thread

    ctx = zmq.Context(io_threads=64)
    try:
        router = ctx.socket(zmq.ROUTER)
        endpoints = bind_per_io_thread(router, "127.0.0.1", 64)
        assert len(set(endpoints)) == 64
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.AFFINITY, affinity_mask(63))
        dealer.connect(endpoints[63])
        dealer.send(b"to the last thread")
        assert router.poll(10_000), "nothing arrived through I/O thread 63 within 10 s"
        assert router.recv_multipart()[1] == b"to the last thread"
        for sock in (router, dealer):
            sock.close(linger=0)
    finally:
        ctx.term()
    with pytest.raises(ValueError, match="I/O thread 64 out of range"):
        affinity_mask(64)


def test_stripes_keep_a_key_on_one_connection_and_balance_bytes() -> None:
    stripes = Stripes(servers=2, connections=3)
    sizes = {0: 900, 1: 100, 2: 100, 3: 300, 4: 100, 5: 500, 6: 100}
    first = {key: stripes.of(key % 2, key, nbytes) for key, nbytes in sizes.items()}
    # server 0 (even keys): 900 -> 0, 100 -> 1, 100 -> 2, 100 -> 1; server 1: 100, 300, 500
    assert first == {0: 0, 2: 1, 4: 2, 6: 1, 1: 0, 3: 1, 5: 2}
    assert {key: stripes.of(key % 2, key) for key in sizes} == first  # stable
    again = Stripes(servers=2, connections=3)  # another worker: the same assignment
    assert {key: again.of(key % 2, key, nbytes) for key, nbytes in sizes.items()} == first


@pytest.mark.parametrize(("change", "fragment"), [
    ({"DMLC_ROLE": None}, "DMLC_ROLE is not set"),
    ({"DMLC_PS_ROOT_URI": None}, "DMLC_PS_ROOT_URI is not set"),
    ({"DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT=70000 out of range"),
    ({"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER='two' is not an integer"),
    ({"DMLC_WORKER_ID": "4"}, "DMLC_WORKER_ID=4 out of range"),
    ({"BYTEPS_LOCAL_RANK": "1"}, "BYTEPS_LOCAL_RANK=1 out of range"),
    ({"BYTEPS_PARTITION_BYTES": "0"}, "BYTEPS_PARTITION_BYTES=0 out of range"),
    ({"BPS_TIMEOUT": "nan"}, "BPS_TIMEOUT='nan'"),
    ({"BPS_HEARTBEAT_INTERVAL": "2", "BPS_HEARTBEAT_TIMEOUT": "1"}, "BPS_HEARTBEAT_TIMEOUT=1.0"),
    ({"BPS_FRAME_BYTES": "100"}, "BPS_FRAME_BYTES=100 must be 0"),
    ({"BPS_SERVER_THREADS": "0"}, "BPS_SERVER_THREADS=0 out of range"),
    ({"BPS_SERVER_THREADS": "many"}, "BPS_SERVER_THREADS='many' is not an integer"),
    ({"BPS_CONNECTIONS_PER_SERVER": "0"}, "BPS_CONNECTIONS_PER_SERVER=0 out of range"),
    ({"BPS_IO_THREADS": "many"}, "BPS_IO_THREADS='many' is not an integer"),
])
def test_env_errors_name_the_variable(change: dict, fragment: str) -> None:
    environ = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(EnvError, match=re.escape(fragment)):
        ClusterEnv.from_environ(environ)


def test_header_round_trip() -> None:
    frame = encode(Op.PUSH, rid=7, key=2**63 - 1, step=3, node=1, dtype="float16", numel=10,
                   nbytes=20, lr=0.5)
    header = decode(frame)
    assert header["op"] is Op.PUSH and header["key"] == 2**63 - 1 and header["lr"] == 0.5


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=40000), st.sampled_from([0, MIN_FRAME_BYTES, 5000, 16384, 10**6]))
def test_payload_frames_round_trip(body: bytes, frame_bytes: int) -> None:
    frames = payload_frames(memoryview(body), frame_bytes)
    sizes = [len(f) for f in frames]
    check_payload("PUSH key 1", len(body), sizes)
    if frame_bytes and len(body) > frame_bytes:  # cut: all but the last of frame_bytes
        assert sizes[:-1] == [frame_bytes] * (len(sizes) - 1) and 0 < sizes[-1] <= frame_bytes
    else:
        assert sizes == [len(body)]
    assert join_frames(frames).tobytes() == body
    out = np.zeros(len(body), dtype=np.uint8)
    assert join_frames(frames, out) is out and out.tobytes() == body


@pytest.mark.parametrize(("nbytes", "sizes", "fragment"), [
    (10000, [], "0 payload frames, expected 1"),
    (10000, [9999], "field 'nbytes'=10000 but the payload has 9999 bytes"),
    (10000, [4096, 4096], "2 payload frames, expected 3"),
    (10000, [4096, 4096, 1808, 0], "4 payload frames, expected 3"),
    (10000, [4096, 5000, 904], "payload frame 1 has 5000 bytes, expected 4096"),
    (10000, [5000, 4096, 904], "3 payload frames, expected 2"),
    (12288, [4096, 4096, 4000],
     "field 'nbytes'=12288 but the last payload frame has 4000 bytes, expected 4096"),
    (10000, [100] * 100, "payload frames of 100 bytes, less than 4096"),
    (2**40, [4096, 4096], "field 'nbytes'=1099511627776 out of range"),
    (-1, [0], "field 'nbytes'=-1 out of range"),
])
def test_a_payload_in_the_wrong_frames_is_refused_naming_the_field(
        nbytes: int, sizes: list[int], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(f"PUSH key 3: {fragment}")):
        check_payload("PUSH key 3", nbytes, sizes, limit=2**33)


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"v": PROTOCOL_VERSION + 1, "op": int(Op.PULL), "rid": 1, "key": 1, "step": 0},
     "protocol version"),
    ({"v": PROTOCOL_VERSION, "op": 1234}, "field 'op' has unknown value 1234"),
    ({"v": PROTOCOL_VERSION, "op": [1]}, r"field 'op' has unknown value \[1\]"),
    ({"v": PROTOCOL_VERSION, "op": {"a": 1}}, "field 'op' has unknown value {'a': 1}"),
    ({"v": PROTOCOL_VERSION, "op": True}, "field 'op' has unknown value True"),
    ({"v": PROTOCOL_VERSION, "op": int(Op.PULL), "rid": 1, "key": 1}, "field 'step' missing"),
    ({"v": PROTOCOL_VERSION, "op": int(Op.PULL), "rid": 1, "key": True, "step": 0},
     "field 'key' has type bool"),
    ({"v": PROTOCOL_VERSION, "op": int(Op.PUSH), "rid": 1, "key": 1, "step": 0, "node": 0,
      "dtype": "float32", "numel": 1, "nbytes": 4, "lr": math.inf}, "field 'lr' is inf"),
])
def test_bad_headers_name_the_field(fields: dict, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        decode(msgpack.packb(fields))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**5), st.sampled_from([2, 4, 8]), st.integers(64, 10**5))
def test_partition_covers_tensor_within_budget(numel: int, itemsize: int, budget: int) -> None:
    parts = partition(numel, itemsize, budget)
    assert sum(length for _, length in parts) == numel
    assert all(o2 == o1 + n1 for (o1, n1), (o2, _) in zip(parts, parts[1:], strict=False))
    assert all(length * itemsize <= budget for _, length in parts)


def test_placement_is_greedy_least_loaded_and_deterministic() -> None:
    sizes = [400, 100, 100, 100, 300, 50, 50]
    placements = []
    for _ in range(2):
        placement = Placement(3)
        placements.append([placement.place(k, n) for k, n in enumerate(sizes)])
    assert placements[0] == placements[1] == [0, 1, 2, 1, 2, 1, 1]
    assert placement.loads == [400, 300, 400]
    assert placement.place(4, 300) == 2  # a placed key keeps its server
    placement.unplace(6, 50)
    assert placement.loads == [400, 250, 400] and 6 not in placement.servers


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=100), st.integers(1, 8))
def test_placement_balance_bound(sizes: list[int], servers: int) -> None:
    placement = Placement(servers)
    for key, nbytes in enumerate(sizes):
        placement.place(key, nbytes)
    if len(sizes) >= servers:
        assert max(placement.loads) - min(placement.loads) <= max(sizes)


def optimal_max_load(sizes: list[int], servers: int, loads: list[int] | None = None) -> int:
    """The smallest possible largest load, by trying every assignment."""
    start = loads or [0] * servers
    best = math.inf
    for assignment in itertools.product(range(servers), repeat=len(sizes)):
        totals = list(start)
        for server, size in zip(assignment, sizes, strict=True):
            totals[server] += size
        best = min(best, max(totals))
    return best


def plan_loads(sizes: list[int], servers: list[int], count: int,
               loads: list[int] | None = None) -> list[int]:
    totals = list(loads or [0] * count)
    for server, size in zip(servers, sizes, strict=True):
        totals[server] += size
    return totals


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.booleans()), min_size=1, max_size=12),
       st.sampled_from([64, 160, 400]))
def test_small_tensors_fuse_greedily_within_a_span_of_other_gradients(
        tensors: list[tuple[int, bool]], partition_bytes: int) -> None:
    """In backward order, a bucket takes every next small tensor that fits its capacity,
    until more than a partition of other gradients (float32 bytes) came after its first
    member: the plan holds each small tensor once, keeps both bounds, and closes no
    bucket that the next small tensor could have joined."""
    import torch

    from bps.worker.planning import Part, plan_buckets

    numels = [numel for numel, _ in tensors]
    names = [f"t{i}" for i in range(len(tensors))]
    small = {i: Part(0, numel) for i, (numel, is_small) in enumerate(tensors) if is_small}
    capacity = partition_bytes // 2  # float16 elements
    plans, buckets = plan_buckets(names, small, torch.float16, partition_bytes, numels)
    groups = []  # tensor indices per key, in backward order
    for plan in plans:
        members = plan.name.removeprefix("fused(").removesuffix(")").split(", ")
        groups.append([int(m.removesuffix("[0]")[1:]) for m in members])
    assert sorted(i for g in groups for i in g) == sorted(small)
    assert len(buckets) == sum(len(g) > 1 for g in groups)
    for plan, group in zip(plans, groups, strict=True):  # members packed in their order
        if len(group) > 1:
            assert any(plan.part is b for b in buckets)
            assert plan.numel == sum(numels[i] for i in group)
            assert [small[i].bucket_offset for i in group] == list(
                itertools.accumulate([numels[i] for i in group[:-1]], initial=0))

    def between(first: int, last: int) -> int:  # other gradients' float32 bytes
        return 4 * sum(numels[j] for j in range(last + 1, first) if j not in small)

    for n, group in enumerate(groups):
        following = groups[n + 1] if n + 1 < len(groups) else None
        assert group == sorted(group, reverse=True)  # backward order
        assert sum(numels[i] for i in group) <= capacity or len(group) == 1
        assert between(group[0], group[-1]) <= partition_bytes
        if following is not None:  # the next small tensor could not have joined
            nxt = following[0]
            assert (sum(numels[i] for i in group) + numels[nxt] > capacity
                    or between(group[0], nxt) > partition_bytes)


def test_plan_servers_places_largest_first() -> None:
    # in declaration order the two small keys would take both servers and the large
    # one would land on top of one of them (largest load 30)
    assert plan_servers([10, 10, 20], 2) == [1, 1, 0]
    assert plan_servers([10, 10, 20], 2, loads=[0, 25]) == [0, 1, 0]
    assert plan_servers([], 3) == []
    with pytest.raises(ValueError, match="2 loads for 3 servers"):
        plan_servers([1], 3, loads=[0, 0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=7), st.integers(1, 3),
       st.lists(st.integers(0, 500), min_size=3, max_size=3))
def test_plan_servers_within_lpt_bound(sizes: list[int], servers: int, start: list[int]) -> None:
    start = start[:servers]
    plan = plan_servers(sizes, servers, start)
    assert plan == plan_servers(list(sizes), servers, list(start))  # deterministic
    assert all(0 <= s < servers for s in plan)
    largest = max(plan_loads(sizes, plan, servers, start))
    # Graham: LPT's largest load is at most 4/3 - 1/(3m) of the optimum (from a common
    # start, the same argument bounds it by the optimum plus a third of it)
    assert largest <= optimal_max_load(sizes, servers, start) * 4 / 3 + 1e-9


def mlp_keys(compressed_bytes, warmup: bool = False) -> list:
    """The trainer's key plans for bench/slow_network.py's MLP (784-1100-1100-10, 2 MB
    partitions, fp16 raw keys): the two large weights compressed, the tensors under
    64 KB raw, with the last layer and the second bias fused (next to each other in
    backward order) and the first bias alone."""
    import torch

    from bps.worker.planning import KeyPlan, Part

    plans = []
    for numel in (784 * 1100, 1100 * 1100):
        for _, length in partition(numel, 4, 2048000):
            part = Part(0, length)
            if warmup:
                plans.append(KeyPlan(part, "raw_key", "", length, torch.float16, None,
                                      2 * length, warmup_only=True))
            plans.append(KeyPlan(part, "compressed_key", "", length, torch.float32, {},
                                  compressed_bytes(length)))
    for numel in (1100, 1100 + 1100 * 10 + 10):
        plans.append(KeyPlan(Part(0, numel), "raw_key", "", numel, torch.float16, None,
                              2 * numel))
    return plans


def test_plan_key_servers_balances_bytes_on_the_wire() -> None:
    from bps.worker.planning import plan_key_servers

    def topk(numel: int) -> int:  # docs/compression.md: k int32 indices and k float32 values
        return int(numel * 0.01) * 8 + 16

    keys = mlp_keys(topk)
    wire = [k.wire_bytes for k in keys]
    planned = max(plan_loads(wire, plan_key_servers(keys, 4), 4))
    assert planned <= optimal_max_load(wire, 4) * 4 / 3
    # placed by raw bytes in declaration order, the fused key (24 KB per push in fp16)
    # lands on a server that already holds a 512,000-weight partition
    by_raw = Placement(4)
    raw = [by_raw.place(i, k.numel * k.dtype.itemsize) for i, k in enumerate(keys)]
    assert max(plan_loads(wire, raw, 4)) > 1.1 * planned

    # with warmup, the raw keys of compressed partitions carry the first steps: balanced
    # on top of the raw keys every step uses
    keys = mlp_keys(topk, warmup=True)
    servers = plan_key_servers(keys, 4)
    steady = [i for i, k in enumerate(keys) if not k.warmup_only]
    assert [servers[i] for i in steady] == plan_key_servers([keys[i] for i in steady], 4)
    warm = [i for i, k in enumerate(keys) if k.params is None]  # what warmup steps push
    warm_sizes = [keys[i].wire_bytes for i in warm]
    warm_loads = plan_loads(warm_sizes, [servers[i] for i in warm], 4)
    assert max(warm_loads) <= optimal_max_load(warm_sizes, 4) * 4 / 3


def test_waiting_pushes_go_out_by_step_then_priority_within_credit() -> None:
    queues = SendQueues(num_servers=2, credit=2)
    seq = iter(range(100))
    item = {}

    def put(server: int, step: int, priority: int, name: str) -> None:
        order = send_order(step, priority, next(seq))
        item[order] = name
        queues.put(server, order)

    put(0, 0, 0, "first")
    put(0, 0, -5, "low")
    put(0, 0, 7, "high")
    put(0, 1, 100, "next-step")
    put(0, 0, 7, "high-later")
    put(1, 0, 0, "other-server")
    assert [item[o] for o in queues.take()] == ["high", "high-later", "other-server"]
    assert queues.take() == []  # server 0 has no credit left
    queues.release(0)
    assert [item[o] for o in queues.take()] == ["first"]
    queues.release(0)
    queues.release(0)
    assert [item[o] for o in queues.take()] == ["low", "next-step"]
    assert queues.clear() == []


def test_own_stall_is_not_taken_for_a_silent_peer() -> None:
    """After the scheduler's loop (or a node's I/O thread) did not run for a while, the
    heartbeats it missed do not make a peer dead; silence while it runs still does."""
    import time

    import zmq

    from bps.common.protocol import ClusterError
    from bps.common.scheduler_client import STALL_INTERVALS, SchedulerClient
    from bps.server.scheduler import Scheduler, _Node

    env = ClusterEnv.from_environ({**BASE, "DMLC_PS_ROOT_URI": "127.0.0.1"})
    silence = env.heartbeat_timeout + 20
    assert silence > STALL_INTERVALS * env.heartbeat_interval
    now = time.monotonic()
    scheduler = Scheduler(env)
    node = scheduler.nodes[b"w"] = _Node(b"w", "worker", 0, "", last_seen=now - silence)
    scheduler.loop_clock.last = now - silence  # the scheduler itself was paused
    assert scheduler._silent_node(now) is None and node.last_seen == pytest.approx(now)
    node.last_seen = now - silence  # the scheduler ran, the node did not report
    assert scheduler._silent_node(now + 0.5) is node
    # silent for 1 s before a pause of the scheduler: that second still counts after it
    # (a loop that stalls every few seconds must still see a dead peer)
    node.last_seen = now + 0.5 - 1.0
    scheduler.loop_clock.last = now + 0.5
    after = now + 0.5 + silence
    dead_at = after + env.heartbeat_timeout - 1.0
    for turn in range(int((dead_at - after) / 0.5)):  # the loop runs every 0.5 s again
        assert scheduler._silent_node(after + 0.5 * turn) is None
    assert scheduler._silent_node(dead_at + 0.1) is node
    node.finalized = True
    assert scheduler._silent_node(now + 1.0) is None

    client = SchedulerClient(zmq.Context.instance(), env, role="worker")
    try:
        client.tick()  # the scheduler never answered: its silence counts only from then
        client.heard = True
        client.last_seen = client.tick_clock.last = time.monotonic() - silence  # paused
        client.tick()
        client.last_seen = time.monotonic() - silence  # ticking, but the scheduler is silent
        with pytest.raises(ClusterError, match=r"tcp://127\.0\.0\.1:9000 unreachable"):
            client.tick()
    finally:
        client.close(linger=0)


def test_a_worker_that_stopped_stepping_is_named_whenever_its_step_was_reported() -> None:
    """The scheduler's stall rule: a worker behind the leader's step, pushing nothing for
    BPS_HEARTBEAT_TIMEOUT while the leader waits as long, is named, also where its last
    step's heartbeat arrived after the leader's (each node heartbeats in its own phase);
    one that pushed within the timeout is not, and neither is anyone before the leader
    has waited the timeout."""
    import time

    import zmq

    from bps.server.scheduler import Scheduler, _Node

    env = ClusterEnv.from_environ({**BASE, "DMLC_PS_ROOT_URI": "127.0.0.1"})
    timeout, start = env.heartbeat_timeout, time.monotonic()
    scheduler = Scheduler(env)
    scheduler.sock = zmq.Context.instance().socket(zmq.ROUTER)  # PEER_DEAD to nobody
    try:
        nodes = [_Node(f"w{rank}".encode(), "worker", rank, "127.0.0.1", last_seen=start)
                 for rank in range(3)]
        scheduler.nodes = {node.identity: node for node in nodes}
        steps = [(3, start), (2, start + 0.1), (2, start + 0.2)]  # 1 and 2 heard after 0
        for node, (step, since) in zip(nodes, steps, strict=True):
            node.step, node.step_since = step, since
        scheduler._check_stalls(start + timeout - 0.1)  # the leader has not waited enough
        assert scheduler.verdict is None
        nodes[2].step_since = start + timeout  # worker 2 pushed again since: not it
        scheduler._check_stalls(start + timeout + 0.5)
        assert scheduler.verdict is not None
        assert scheduler.verdict.startswith("worker 1 at 127.0.0.1 stopped stepping: its "
                                            "last push was of step 2"), scheduler.verdict
        assert "while worker 0 at 127.0.0.1 has waited" in scheduler.verdict
    finally:
        scheduler.sock.close(linger=0)


def one_worker_scheduler_env(cluster_key: str) -> ClusterEnv:
    """A scheduler's environment for one worker and one server, on a free loopback port."""
    from bps.launch.role import free_port

    return ClusterEnv.from_environ({**BASE, "DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "1",
                                    "DMLC_NUM_SERVER": "1", "DMLC_WORKER_ID": "0",
                                    "DMLC_PS_ROOT_URI": "127.0.0.1",
                                    "DMLC_PS_ROOT_PORT": str(free_port()),
                                    "BPS_SECRET_FILE": cluster_key})


def test_scheduler_sends_its_last_messages_before_it_returns(cluster_key: str) -> None:
    """When every worker has said FINALIZE, the scheduler answers BYE, sends the servers
    SHUTDOWN and returns 0. By then it has terminated its own ZeroMQ context, which only
    returns once those last messages are sent: pyzmq drops what is still queued at
    interpreter exit, and a server that missed SHUTDOWN would fail the job 10 s later."""
    import threading

    import zmq

    from bps.common.auth import load_key
    from bps.common.scheduler_client import SchedulerClient
    from bps.server.scheduler import Scheduler

    env = one_worker_scheduler_env(cluster_key)
    scheduler = Scheduler(env)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(scheduler.run()), daemon=True)
    thread.start()
    ctx = zmq.Context()
    worker = SchedulerClient(ctx, env, "worker", key=load_key(env))
    server = SchedulerClient(ctx, env, "server", "tcp://127.0.0.1:1", key=load_key(env))

    def next_op(client: SchedulerClient) -> Op:
        assert client.sock.poll(10_000), f"{client.role}: nothing from the scheduler in 10 s"
        return client.receive()["op"]

    try:
        worker.send(Op.HELLO, role="worker", worker_id=0, addr="", token=worker.token)
        server.send(Op.HELLO, role="server", worker_id=-1, addr=server.addr, token=b"")
        assert (next_op(worker), next_op(server)) == (Op.WELCOME, Op.WELCOME)
        worker.send(Op.FINALIZE, step=-1)
        assert (next_op(worker), next_op(server)) == (Op.BYE, Op.SHUTDOWN)
        thread.join(timeout=10)
        assert not thread.is_alive() and codes == [0]
        assert scheduler.sock.closed and scheduler.sock.context.closed
    finally:
        worker.close(linger=0)
        server.close(linger=0)
        ctx.term()


def test_the_welcome_carries_each_servers_endpoints(cluster_key: str) -> None:
    """A server's HELLO lists its endpoints (one per I/O thread); the WELCOME hands them
    to the workers in server order. Malformed lists are refused, naming the field."""
    import threading

    import zmq

    from bps.common.auth import load_key
    from bps.common.scheduler_client import SchedulerClient
    from bps.server.scheduler import Scheduler

    env = one_worker_scheduler_env(cluster_key)
    scheduler = Scheduler(env)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    ctx = zmq.Context()
    clients = [SchedulerClient(ctx, env, role, addr, key=load_key(env))
               for role, addr in (("worker", ""), ("server", "tcp://127.0.0.1:1"))]
    worker, server = clients

    def answer(client: SchedulerClient) -> dict:
        assert client.sock.poll(10_000), f"{client.role}: nothing from the scheduler in 10 s"
        return decode(client.sock.recv())

    try:
        for bad in ([], "tcp://127.0.0.1:1", [7], ["udp://127.0.0.1:1"],
                    ["tcp://127.0.0.1:1"] * 65, ["tcp://127.0.0.1"], ["tcp://:5"],
                    ["tcp://127.0.0.1:port"], ["tcp://127.0.0.1:70000"]):
            server.send(Op.HELLO, role="server", worker_id=-1, addr=server.addr, token=b"",
                        endpoints=bad)
            refusal = answer(server)
            assert refusal["op"] == Op.ERROR and "field 'endpoints'" in refusal["msg"], bad
        ends = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        server.send(Op.HELLO, role="server", worker_id=-1, addr=server.addr, token=b"",
                    endpoints=ends)
        worker.send(Op.HELLO, role="worker", worker_id=0, addr="", token=worker.token)
        welcome = answer(worker)
        assert welcome["op"] == Op.WELCOME and welcome["endpoints"] == [ends]
        assert server_endpoints(welcome, welcome["servers"]) == [ends]
        assert answer(server)["op"] == Op.WELCOME
        worker.send(Op.FINALIZE, step=-1)
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        for client in clients:
            client.close(linger=0)
        ctx.term()


def test_a_welcome_without_endpoints_means_each_servers_address() -> None:
    servers = ["tcp://10.0.0.1:5", "tcp://10.0.0.2:5"]
    assert server_endpoints({}, servers) == [[servers[0]], [servers[1]]]
    for bad in ([["tcp://10.0.0.1:5"]], [["tcp://10.0.0.1:5"], []], "x",
                [["tcp://10.0.0.1:5"], [3]]):
        with pytest.raises(ClusterError, match="field 'endpoints'"):
            server_endpoints({"endpoints": bad}, servers)


def test_scheduler_port_in_use_is_a_clear_error(caplog, cluster_key: str) -> None:
    """A scheduler address that is taken names the address and the variables behind it,
    and the scheduler returns 1 instead of raising."""
    import socket

    from bps.server.scheduler import Scheduler

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = ClusterEnv.from_environ({**BASE, "DMLC_ROLE": "scheduler",
                                       "DMLC_PS_ROOT_URI": "127.0.0.1",
                                       "DMLC_PS_ROOT_PORT": str(port),
                                       "BPS_SECRET_FILE": cluster_key})
        assert Scheduler(env).run() == 1
    assert (f"scheduler cannot listen on tcp://127.0.0.1:{port} (DMLC_PS_ROOT_URI, "
            "DMLC_PS_ROOT_PORT): Address already in use") in caplog.text


def test_a_hook_reuses_the_flat_view_of_the_gradient_it_is_handed() -> None:
    """The trainer hands ``.grad`` and its flat view: the view itself comes back (no
    torch op, each of which releases the GIL); anything else gets a view of its own."""
    import torch

    from bps.core.grad_pipeline import _flat

    grad = torch.arange(6.0).reshape(2, 3)
    flat = grad.view(-1)
    assert _flat(grad, flat) is flat
    for dest in (torch.arange(6.0), grad.view(-1)[1:], grad.t().reshape(-1),
                 grad.view(-1).view(torch.int32)):
        got = _flat(grad, dest)  # other memory, a shifted start, another order, dtype
        assert got is not dest and got.data_ptr() == grad.data_ptr()
        assert torch.equal(got, torch.arange(6.0))
    wanted = torch.zeros(3, requires_grad=True)
    assert not _flat(wanted, wanted.detach()).requires_grad


def test_forward_settles_the_bucket_future_unless_cancelled(caplog) -> None:
    from concurrent.futures import CancelledError, Future

    import torch

    from bps.core.grad_pipeline import _BucketSlice, _forward

    source, target = Future(), Future()
    _forward(source, target)
    source.set_result(torch.arange(6.0))
    assert _BucketSlice(target, 2, 3).result(timeout=0).tolist() == [2.0, 3.0, 4.0]

    source, target = Future(), Future()
    _forward(source, target)
    source.set_exception(ValueError("server 1: refused"))
    with pytest.raises(ValueError, match="refused"):
        _BucketSlice(target, 0, 1).result(timeout=0)

    # close() cancels a bucket whose step never completed; a late aggregate is dropped
    # quietly (set_result on a cancelled future would raise inside the callback)
    source, target = Future(), Future()
    _forward(source, target)
    target.cancel()
    with caplog.at_level("ERROR", logger="concurrent.futures"):
        source.set_result(torch.zeros(2))
    assert not caplog.records
    with pytest.raises(CancelledError):
        target.result(timeout=0)


def test_codec_work_after_shutdown_fails_its_request_not_the_caller() -> None:
    """A reply that arrives as the process exits (the codec pool, or the interpreter,
    shut down) fails its request; the I/O thread that received it goes on."""
    import concurrent.futures
    from types import SimpleNamespace

    from bps.common.protocol import ClusterError
    from bps.worker.codec_pool import CodecPool

    pool = CodecPool(count=lambda **deltas: None, threads=1)
    pool.shutdown()
    request = SimpleNamespace(info=None, future=concurrent.futures.Future())
    pool.decompress(request, [])
    with pytest.raises(ClusterError, match="engine closed: cannot schedule new futures"):
        request.future.result(timeout=5)


def test_drain_yields_the_waiting_messages_in_order_and_never_blocks() -> None:
    """Multipart messages waiting on a real socket come out whole and in order, at most
    ``limit`` a call; an empty socket yields nothing at once (a blocking receive would
    hang here, since nothing else is ever sent)."""
    import zmq

    import bps.common.protocol
    from bps.common.protocol import drain

    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://drain-test")
        dealer.connect("inproc://drain-test")
        for i in range(5):
            dealer.send_multipart([b"head%d" % i, b"body%d" % i])
        first = [[f.bytes for f in frames[1:]] for frames in drain(router, limit=3)]
        rest = [[f.bytes for f in frames[1:]] for frames in drain(router)]
        assert first == [[b"head%d" % i, b"body%d" % i] for i in range(3)]
        assert rest == [[b"head%d" % i, b"body%d" % i] for i in (3, 4)]
        assert list(drain(router)) == []
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
    assert doctest.testmod(bps.common.protocol).failed == 0
