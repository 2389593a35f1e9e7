"""LAST, a worker's last answer of a key handed to a replacement server, passes the
request checks (:func:`bps.server.requests.check_request`) like a push: its payload
frames as its header says, from a member's connection only."""

from __future__ import annotations

import pytest

from bps.common.protocol import TOKEN_BYTES, Op, ProtocolError, decode, encode
from bps.server.requests import check_request

TOKEN = b"\x01" * TOKEN_BYTES
LIMIT = 1 << 20


def last(nbytes: int, skip: dict | None = None) -> dict:
    return decode(encode(Op.LAST, rid=3, key=7, step=4, nbytes=nbytes, skip=skip))


def test_a_last_answer_with_its_payload_or_a_skip_passes() -> None:
    check_request(TOKEN + b"engine0", last(8), [8], {TOKEN: 0}, LIMIT)
    check_request(TOKEN + b"engine0", last(0, {"skip": "nonfinite", "skip_node": 1,
                                               "skip_what": "w"}), [0], {TOKEN: 0}, LIMIT)


def test_frames_unlike_the_header_or_a_stranger_are_refused() -> None:
    with pytest.raises(ProtocolError, match="LAST key 7"):
        check_request(TOKEN + b"engine0", last(8), [], {TOKEN: 0}, LIMIT)
    with pytest.raises(ProtocolError, match="LAST key 7: this connection belongs to no "
                                            "worker of this job"):
        check_request(b"\x02" * TOKEN_BYTES, last(8), [8], {TOKEN: 0}, LIMIT)
    with pytest.raises(ProtocolError, match="LAST: field 'skip' missing"):
        decode(encode(Op.LAST, rid=3, key=7, step=4, nbytes=0))
