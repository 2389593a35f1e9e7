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
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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
