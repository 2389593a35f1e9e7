"""How many connections each worker opens to each server, and how many ZeroMQ I/O threads
a process gives its context, from the cores this host lends the job.

libzmq runs a connection's CURVE encryption and decryption in the one I/O thread that
owns the connection, so one connection moves at most one core's cipher speed. A worker
therefore opens ``connections`` DEALERs to each server and sends every key on one of
them (:class:`Stripes`: all of one key's requests, in order, on one connection), and
both sides give their contexts I/O threads enough for the connections they hold.

The defaults share the cores of ``os.sched_getaffinity`` by the work each process does:
every byte is encrypted by one side and decrypted by the other, so a server, which
handles every worker's traffic, needs as many cores as all of its workers together.
Where the job runs on one host (its scheduler on loopback), a worker node gets
``cores / (2 * workers)`` and a server ``cores / (2 * servers)``; elsewhere a worker
shares its host only with the servers at its own address, and a server takes the host::

    >>> worker, server = core_shares(cores=16, workers=2, servers=1, on_one_host=True)
    >>> worker, server, default_connections(worker, servers=1)
    (4, 8, 4)
    >>> io_threads(worker, connections=1 * 4), io_threads(server, connections=2 * 4)
    (4, 8)
    >>> stripes = Stripes(servers=1, connections=2)
    >>> [stripes.of(0, key, nbytes) for key, nbytes in [(0, 400), (1, 100), (2, 100)]]
    [0, 1, 1]

Which I/O thread serves a connection is fixed, not left to libzmq. Left to itself,
libzmq gives a new connection to the thread with the fewest registered sockets, and
counts a connection only once that thread has taken it: connections that arrive
together all go to one thread, which then encrypts for all of them while the others
idle. So a server binds one endpoint per I/O thread, each listener pinned to its thread
with ``ZMQ_AFFINITY`` (:func:`bind_per_io_thread`), and each worker pins every
connection to one of its own threads and connects it to one of those endpoints
(:func:`pinned_connection`), so that the job's connections are dealt evenly over both
sides' threads::

    >>> [pinned_connection(node, 0, stripe, connections=2, endpoints=4, threads=2)
    ...  for node in (0, 1) for stripe in (0, 1)]
    [(0, 0), (1, 1), (2, 0), (3, 1)]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

MAX_CONNECTIONS = 8  # per worker-server pair, by default: more gains little (docs/benchmarks.md)
MAX_IO_THREADS = 64
MAX_SERVER_THREADS = 64  # engine threads of one server

_LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``tcp://host:port``) names this machine's loopback."""
    if "://" in host:
        host = host.split("://", 1)[1].rsplit(":", 1)[0]
    return host.startswith(_LOOPBACK)


def core_shares(cores: int, workers: int, servers: int, on_one_host: bool,
                servers_beside: int = 0) -> tuple[int, int]:
    """(a worker node's, a server's) share of a host of ``cores`` cores: see the module
    docstring; ``servers_beside``: servers at a worker's own address (not on one host)."""
    if on_one_host:
        return max(1, cores // (2 * workers)), max(1, cores // (2 * servers))
    return max(1, cores // (1 + servers_beside)), max(1, cores)


def default_connections(share: int, servers: int) -> int:
    """Connections per server for a worker with ``share`` cores and ``servers`` servers:
    one core per connection, at most :data:`MAX_CONNECTIONS`, at least 1 (two
    connections sharing one I/O thread interleave their messages, so each arrives later,
    and gain nothing: docs/benchmarks.md)."""
    return max(1, min(MAX_CONNECTIONS, share // max(1, servers)))


def io_threads(share: int, connections: int) -> int:
    """I/O threads for a process holding ``connections`` data connections: one per
    connection, at most its ``share`` of the cores, at least 1."""
    return max(1, min(share, connections, MAX_IO_THREADS))


class Stripes:
    """Which of a server's ``connections`` carries each key: the one with the fewest
    bytes of keys so far, in the order keys are first seen (lowest index on a tie); a
    key keeps its connection, so its requests arrive in the order they were sent."""

    def __init__(self, servers: int, connections: int) -> None:
        self.connections = connections
        self.loads = [[0] * connections for _ in range(servers)]
        self.stripe: dict[int, int] = {}

    def of(self, server: int, key: int, nbytes: int = 0) -> int:
        """The connection index of ``key`` on ``server`` (assigned on first sight)."""
        stripe = self.stripe.get(key)
        if stripe is None:
            loads = self.loads[server]
            stripe = self.stripe[key] = min(range(self.connections), key=lambda c: (loads[c], c))
            loads[stripe] += nbytes
        return stripe


def proc_threads() -> list[tuple[int, str, float]]:
    """(thread id, OS name, CPU seconds user + system) of each of this process's threads,
    in thread-id order, from ``/proc/self/task`` (which counts in ticks of 10 ms); empty
    where /proc is not there.

        >>> any(name for _, name, _ in proc_threads())
        True
    """
    tick = os.sysconf("SC_CLK_TCK")
    threads = []
    try:
        tasks = sorted(os.listdir("/proc/self/task"), key=int)
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        threads.append((int(tid), name, (int(fields[11]) + int(fields[12])) / tick))
    return threads


def io_thread_cpu_seconds() -> list[float]:
    """CPU seconds (user + system) of each of this process's ZeroMQ I/O threads, in
    thread-id order; empty where /proc is not there. libzmq gives each connection to
    one I/O thread, which does all of its CURVE work: the spread shows whether the
    connections shared the threads.

        >>> all(s >= 0 for s in io_thread_cpu_seconds())
        True
    """
    return [seconds for _, name, seconds in proc_threads() if name.startswith("ZMQbg/IO/")]


def affinity_mask(thread: int) -> int:
    """The ``ZMQ_AFFINITY`` value that names I/O thread ``thread`` (0-63) alone: bit
    ``thread`` of a 64-bit mask, which pyzmq takes as a signed integer.

        >>> affinity_mask(2), affinity_mask(63) == -(1 << 63)
        (4, True)
    """
    if not 0 <= thread < MAX_IO_THREADS:
        raise ValueError(f"I/O thread {thread} out of range: a mask names threads 0-63")
    return (1 << thread) - (1 << 64 if thread == 63 else 0)


def bind_per_io_thread(sock: Any, host: str, threads: int) -> list[str]:
    """Bind ``sock`` (a ZeroMQ socket, its security set) to one random TCP port on
    ``host`` per I/O thread of its context: the connections that listener ``t`` accepts
    run on I/O thread ``t`` (``ZMQ_AFFINITY``, which a listener keeps from its bind).
    Returns the endpoints, in thread order."""
    import zmq  # lazily, as the rest of this module needs none of it

    endpoints = []
    for thread in range(max(1, threads)):
        sock.setsockopt(zmq.AFFINITY, affinity_mask(thread))
        port = sock.bind_to_random_port(f"tcp://{host}")
        endpoints.append(f"tcp://{host}:{port}")
    sock.setsockopt(zmq.AFFINITY, 0)  # later connections: any thread, as before
    return endpoints


def pinned_connection(node: int, server: int, stripe: int, connections: int, endpoints: int,
                      threads: int) -> tuple[int, int]:
    """(the server endpoint, the worker's own I/O thread) of connection ``stripe`` of
    worker ``node`` to ``server``, which has ``endpoints`` endpoints; the worker has
    ``threads`` I/O threads and ``connections`` connections to each server. The workers'
    connections to a server are dealt over its endpoints in node order, and a worker's
    connections over its threads in (server, stripe) order."""
    return ((node * connections + stripe) % max(1, endpoints),
            (server * connections + stripe) % max(1, threads))


def server_endpoints(welcome: dict, servers: list[str]) -> list[list[str]]:
    """Each server's endpoints from a WELCOME (its address alone where the scheduler sent
    none); raises ClusterError for a malformed field.

        >>> server_endpoints({"endpoints": [["tcp://h:1", "tcp://h:2"]]}, ["tcp://h:1"])
        [['tcp://h:1', 'tcp://h:2']]
        >>> server_endpoints({}, ["tcp://h:1"])
        [['tcp://h:1']]
    """
    from bps.common.protocol import ClusterError  # lazily: msgpack is not needed above

    endpoints = welcome.get("endpoints")
    if endpoints is None:
        return [[address] for address in servers]
    if (not isinstance(endpoints, list) or len(endpoints) != len(servers)
            or not all(isinstance(ends, list) and ends and all(isinstance(e, str) for e in ends)
                       for ends in endpoints)):
        raise ClusterError(f"WELCOME: field 'endpoints' must list each of the {len(servers)} "
                           "servers' addresses")
    return endpoints


def engine_threads(cores: int, servers: Sequence[str], address: str) -> int:
    """A server's default engine threads: ``cores`` shared evenly by the servers of the
    job (their addresses, ``servers``) on the host of ``address``; at least 1.

        >>> engine_threads(16, ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"],
        ...                "tcp://127.0.0.1:5002")
        8
        >>> engine_threads(16, ["tcp://10.0.0.1:5001", "tcp://10.0.0.2:5001"],
        ...                "tcp://10.0.0.2:5001")
        16
    """
    host = urlsplit(address).hostname
    here = sum(urlsplit(server).hostname == host for server in servers)
    return max(1, min(MAX_SERVER_THREADS, cores // max(1, here)))
