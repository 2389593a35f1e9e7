"""The wire: headers and payload frames round-trip; bad input raises ProtocolError naming
the field."""

from __future__ import annotations

import doctest
import math
import re

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bps.common.protocol import (
    MIN_FRAME_BYTES,
    PROTOCOL_VERSION,
    Op,
    ProtocolError,
    check_payload,
    decode,
    encode,
    join_frames,
    payload_frames,
    server_seconds,
)


def test_a_reply_server_time_is_read_only_when_it_is_a_time() -> None:
    assert server_seconds(decode(encode(Op.DATA, rid=1, key=2, step=0, nbytes=0,
                                        server_s=0.125))) == 0.125
    for bad in ({}, {"server_s": "1"}, {"server_s": True}, {"server_s": -1.0},
                {"server_s": math.inf}, {"server_s": math.nan}):
        assert server_seconds(bad) == 0.0, bad


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


def test_send_message_keeps_a_message_whole_and_the_next_apart() -> None:
    import zmq

    from bps.common.protocol import send_message

    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://send-message-test")
        dealer.connect("inproc://send-message-test")
        dealer.send(b"hello")
        ident = router.recv_multipart()[0]
        body = memoryview(bytearray(b"x" * 5000))
        send_message(router, [ident, b"head", body[:2500], body[2500:]], copy=False)
        send_message(router, [ident, b"alone"])
        assert dealer.recv_multipart() == [b"head", b"x" * 2500, b"x" * 2500]
        assert dealer.recv_multipart() == [b"alone"]
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
