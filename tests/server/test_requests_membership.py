"""Who may ask once worker nodes left (:func:`bps.server.requests.check_request`): a
departed worker's connection is refused naming the generation it left at, and the
lowest-numbered member present rolls back and restores in worker 0's place."""

from __future__ import annotations

import pytest

from bps.common.protocol import TOKEN_BYTES, Op, ProtocolError
from bps.server.requests import check_request

TOKENS = [bytes([n + 1]) * TOKEN_BYTES for n in range(3)]
LIMIT = 1 << 20


def check(node: int, op: Op, members: dict, left: dict, **fields) -> None:
    header = {"op": op, "key": 7, "rid": 1, "step": 0, "node": node, "nbytes": 0, **fields}
    check_request(TOKENS[node] + b"engine0", header, [0] if op in (Op.PUSH, Op.SET_STATE) else [],
                  members, LIMIT, left)


def test_a_departed_worker_is_refused_naming_the_generation() -> None:
    members = {TOKENS[0]: 0, TOKENS[2]: 2}
    left = {TOKENS[1]: "worker 1 left the job at membership generation 1"}
    check(0, Op.PUSH, members, left)
    with pytest.raises(ProtocolError, match=r"PUSH key 7 refused: worker 1 left the job at "
                                            r"membership generation 1"):
        check(1, Op.PUSH, members, left)
    with pytest.raises(ProtocolError, match="belongs to no worker of this job"):
        check(1, Op.PULL, members, {})


def test_the_lowest_member_present_rolls_back_once_worker_0_left() -> None:
    everyone = {t: n for n, t in enumerate(TOKENS)}
    with pytest.raises(ProtocolError, match="only worker 0 rolls back"):
        check(1, Op.ABORT, everyone, {})
    without_0 = {TOKENS[1]: 1, TOKENS[2]: 2}
    check(1, Op.ABORT, without_0, {})
    check(1, Op.SET_STATE, without_0, {})
    with pytest.raises(ProtocolError, match="only worker 1 rolls back"):
        check(2, Op.ABORT, without_0, {})


def test_a_node_that_joins_again_is_served_and_its_old_incarnation_stays_refused() -> None:
    """Node 1 leaves at generation 1 and joins again at 2 with a new token (a restarted
    process): its requests are served; its old token (a stopped process that resumes)
    is refused naming the generation it left at."""
    from bps.server.requests import update_members

    members, left = {t: n for n, t in enumerate(TOKENS)}, {}
    update_members(members, left, {"generation": 1, "members": [0, 2]})
    restarted = bytes([9]) * TOKEN_BYTES
    update_members(members, left, {"generation": 2, "members": [0, 1, 2],
                                   "joined": [[1, restarted]]})
    header = {"op": Op.PUSH, "key": 7, "rid": 1, "step": 0, "node": 1, "nbytes": 0}
    check_request(restarted + b"engine0", header, [0], members, LIMIT, left)
    with pytest.raises(ProtocolError, match=r"PUSH key 7 refused: worker 1 left the job at "
                                            r"membership generation 1"):
        check(1, Op.PUSH, members, left)
