"""Connections, I/O and engine threads from the host's cores; a key's connection."""

from __future__ import annotations

import doctest
import os

import pytest

import bps.common.striping
import bps.server.server
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
)


def test_server_threads_share_the_host_among_its_servers() -> None:
    here = [f"tcp://10.0.0.1:{port}" for port in (5001, 5002, 5003)]
    servers = [*here, "tcp://10.0.0.2:5001"]
    assert engine_threads(16, servers, here[1]) == 5  # 3 servers share 16 cores
    assert engine_threads(16, servers, servers[3]) == 16
    assert engine_threads(2, servers, here[0]) == 1  # never none
    assert engine_threads(1024, servers, servers[3]) == 64  # BPS_SERVER_THREADS' bound
    assert 1 <= host_cores() <= (os.cpu_count() or 1)
    assert doctest.testmod(bps.common.striping).failed == 0


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
