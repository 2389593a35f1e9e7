"""A parameter server's key engine outside any process of a cluster: requests handed to
it as its engine thread hands them (``Requests.handle``), its replies read from a real
inproc socket."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import zmq

from bps.common.env import ClusterEnv
from bps.server.aggregator import Aggregator
from bps.server.requests import Requests

REPLIES = "inproc://bps-key-engine-replies"


@contextlib.contextmanager
def serving_key_engine(workers: int, **env: str) -> Iterator[tuple[Requests, zmq.Socket]]:
    """What a server's engine thread runs for ``workers`` workers (``env``: more
    variables), replying on a real inproc PUSH socket, and the PULL socket its replies
    arrive on (routing id, header, payload...)."""
    cluster = ClusterEnv.from_environ({
        "DMLC_ROLE": "server", "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": "1",
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", **env})
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    replies.bind(REPLIES)
    out = ctx.socket(zmq.PUSH)
    out.connect(REPLIES)
    try:
        yield Requests(Aggregator(cluster.num_workers), out, cluster), replies
    finally:
        out.close(linger=0)
        replies.close(linger=0)
        ctx.term()
