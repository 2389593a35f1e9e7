"""The parameter server's rules for pushes from members, on a real key engine whose
replies go over a real inproc socket: one waiting push per worker and key, steps within
one of the step in progress, one learning rate per step, bounded key sizes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from bps.common.protocol import Op, decode, encode
from bps.server.aggregator import RequestError
from bps.server.requests import Requests
from tests.harness.key_engine import serving_key_engine

NUMEL = 16


@pytest.fixture
def push() -> Iterator:
    with serving_key_engine(2, BYTEPS_PARTITION_BYTES="65536") as (engine, replies):
        yield _pusher(engine, replies)


def _pusher(engine: Requests, replies: zmq.Socket):
    def request(op: Op, payload: bytes | None = None, replied: bool = True,
                **fields) -> list[dict]:
        """Handle one request as the engine thread would; its replies (ACK, DATA...),
        which are all sent by the time ``handle`` returns."""
        engine.handle(b"peer", decode(encode(op, rid=1, **fields)),
                      None if payload is None else [zmq.Frame(payload)])
        got = []
        while replies.poll(100 if got or not replied else 10_000):
            got.append(decode(replies.recv_multipart()[1]))
        return got

    def push_(node: int, step: int, lr: float = 0.1, key: int = 1) -> list[str]:
        body = b"\0" * (4 * NUMEL)
        return [r["op"].name for r in request(Op.PUSH, body, key=key, step=step, node=node,
                                              dtype="float32", numel=NUMEL,
                                              nbytes=len(body), lr=lr)]

    request(Op.REGISTER, key=1, numel=NUMEL, dtype="float32", name="w", params=None, node=0)
    push_.request = request
    return push_


def test_a_worker_has_one_waiting_push_per_key(push) -> None:
    assert push(1, 0) == ["ACK"]  # held until worker 0 pushes step 0
    with pytest.raises(RequestError, match="worker 1 pushed step 1 while its push of step 0 "
                                           "still waits"):
        push(1, 1)
    assert push(0, 0) == ["ACK", "DATA", "DATA"]


def test_far_future_steps_are_refused(push) -> None:
    assert push(1, 5) == ["ACK"]
    with pytest.raises(RequestError, match="step 0 is more than 1 step away from step 5"):
        push(0, 0)
    assert push(0, 5) == ["ACK", "DATA", "DATA"]  # the step in progress still completes
    assert push(0, 6) == ["ACK"] and push(1, 6) == ["ACK", "DATA", "DATA"]


def test_workers_with_different_learning_rates_get_an_error(push) -> None:
    assert push(0, 0, lr=0.1) == ["ACK"]
    with pytest.raises(RequestError, match=r"step 0: worker 1 pushed learning rate 0.2, but "
                                           r"worker 0 pushed 0.1 for the same step"):
        push(1, 0, lr=0.2)


def test_a_key_larger_than_half_a_message_is_refused_before_allocation(push) -> None:
    with pytest.raises(RequestError, match=r"numel=268435456 \(1073741824 bytes\) is larger "
                                           r"than a key may be \(524256 bytes"):
        push.request(Op.REGISTER, key=2, numel=2**28, dtype="float32", name="huge",
                     params={"compressor": "onebit", "ef": "vanilla"}, node=0)


def test_pulls_cannot_park_future_steps(push) -> None:
    with pytest.raises(RequestError, match="PULL of step 7, which nobody pushed"):
        push.request(Op.PULL, key=1, step=7)
    assert push.request(Op.PULL, key=1, step=0, replied=False) == []  # waits for step 0
    assert push(0, 0) == ["ACK"]
    assert [r["op"].name for r in push.request(Op.PUSH, b"\0" * (4 * NUMEL), key=1, step=0,
                                               node=1, dtype="float32", numel=NUMEL,
                                               nbytes=4 * NUMEL, lr=0.1)] == \
        ["ACK", "DATA", "DATA", "DATA"]  # both pushes and the PULL
