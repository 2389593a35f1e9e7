"""A parameter server's key engine outside any process of a cluster: requests handed to
it as its engine thread would, its replies read from a real inproc socket."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import zmq

from bps.common.env import ClusterEnv
from bps.server.server import ParameterServer, _KeyEngine


@contextlib.contextmanager
def serving_key_engine(workers: int, **env: str) -> Iterator[tuple[_KeyEngine, zmq.Socket]]:
    """A real _KeyEngine of a server for ``workers`` workers (``env``: more variables),
    and the inproc PULL socket its replies arrive on (routing id, header, payload...)."""
    cluster = ClusterEnv.from_environ({
        "DMLC_ROLE": "server", "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": "1",
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", **env})
    ctx = zmq.Context()
    server = ParameterServer(cluster, ctx)
    replies = ctx.socket(zmq.PULL)
    replies.bind(server.replies_address)
    engine = _KeyEngine(server, 0)
    engine.out = ctx.socket(zmq.PUSH)
    engine.out.connect(server.replies_address)
    try:
        yield engine, replies
    finally:
        engine.out.close(linger=0)
        replies.close(linger=0)
        ctx.term()
