"""A parameter server's requests: checked, authorised, and turned into the calls of a
key engine's :class:`~bps.server.aggregator.Aggregator`, whose answers go back as replies.

Usage (what each engine thread of :mod:`bps.server.server` runs; ``out`` is a ZeroMQ
socket, replies go out as ``[routing id, header, payload...]``)::

    requests = Requests(Aggregator(env.num_workers), out, env)
    requests.serve(ident, header, frames)    # a request that check_request let through

Who may ask (see docs/runtime.md, "Security"): the ROUTER is a CURVE server
(:mod:`bps.common.auth`), so only holders of the cluster key connect at all. A request counts
as worker n's only on a connection whose routing id starts with the token the scheduler
gave worker n at rendezvous; REGISTER and PUSH must name that node, SET_STATE and
ABORT come from worker 0 only (:func:`check_member`). A worker has at most one push per
key waiting for its step, and a step more than one away from the step in progress is
refused (:mod:`bps.server.aggregator`). Every header field is checked before anything is
allocated: the op and the payload frames' count and sizes (:func:`check_request`), a
key's range, size (half of ``BPS_MAX_MESSAGE_BYTES``) and dtype, and a push's fields
against its key's declaration (:meth:`Requests.handle`). A refused request gets an ERROR
reply naming the key and field (warnings rate-limited); the server keeps serving
everyone else.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from bps.common.env import ClusterEnv
from bps.common.protocol import (
    TOKEN_BYTES,
    Op,
    ProtocolError,
    check_payload,
    dtype_name,
    encode,
    error_text,
    payload_frames,
    send_message,
    torch_dtype,
)
from bps.common.ratelimit import RateLimitedLog
from bps.compressors.warm import load_soon

from .aggregator import Aggregator, Finished, RequestError

log = logging.getLogger("bps.server")
refusals = RateLimitedLog(log)

MAX_KEY = 2**63
MAX_NUMEL = 2**31 - 1
OPS_WITH_PAYLOAD = (Op.PUSH, Op.SET_STATE, Op.LAST)
KEY_OPS = (Op.REGISTER, Op.PUSH, Op.PULL, Op.GET_STATE, Op.SET_STATE, Op.ABORT, Op.LAST)


def check_request(ident: bytes, header: dict, frame_sizes: list[int],
                  members: dict[bytes, int], max_message_bytes: int,
                  left: dict[bytes, str] | None = None) -> None:
    """A decoded request is a key request of a member (:func:`check_member`) whose payload
    frames (``frame_sizes``) are as its header says; ProtocolError where not.

        >>> check_request(b"tok", {"op": Op.PULL, "key": 1, "step": 0}, [8], {b"tok": 0}, 99)
        Traceback (most recent call last):
        ...
        bps.common.protocol.ProtocolError: PULL: 1 payload frames, expected 0
    """
    op = header["op"]
    if op not in KEY_OPS:
        raise ProtocolError(f"op {op.name} is not a server request")
    check_member(members, ident, header, left)
    if op in OPS_WITH_PAYLOAD:
        check_payload(f"{op.name} key {header['key']}", header["nbytes"], frame_sizes,
                      max_message_bytes)
    elif frame_sizes:
        raise ProtocolError(f"{op.name}: {len(frame_sizes)} payload frames, expected 0")


def update_members(members: dict[bytes, int], left: dict[bytes, str], header: dict) -> None:
    """Apply the scheduler's MEMBERSHIP ``header`` to ``members`` (worker token -> node
    id) and ``left`` (token -> why it is refused): a node that joins (``joined``: its id
    and token) is a member from now on, the tokens of nodes not present are refused
    naming the generation, and so stays the token of an earlier incarnation.

        >>> members, left = {b"a": 0, b"b": 1}, {}
        >>> update_members(members, left, {"generation": 1, "members": [0]})
        >>> update_members(members, left, {"generation": 2, "members": [0, 1],
        ...                                "joined": [[1, b"c"]]})
        >>> members, left
        ({b'a': 0, b'c': 1}, {b'b': 'worker 1 left the job at membership generation 1'})
    """
    generation, present = header["generation"], set(header["members"])
    for node, token in header.get("joined", []):
        for old, other in list(members.items()):
            if other == node:  # an incarnation whose leaving was not announced here
                del members[old]
                left[old] = f"worker {node} was replaced at membership generation {generation}"
        members[bytes(token)] = node
    for token, node in list(members.items()):
        if node not in present:
            del members[token]
            left[token] = f"worker {node} left the job at membership generation {generation}"


def check_member(members: dict[bytes, int], ident: bytes, header: dict,
                 left: dict[bytes, str] | None = None) -> None:
    """The request comes from a connection of the worker it speaks for (``members``:
    worker token -> node id, from the scheduler's WELCOME, less the nodes that left the
    job; ``left``: their tokens -> why, for the refusal). SET_STATE and ABORT come from
    the lowest-numbered member (worker 0 unless it left)."""
    op, key = header["op"], header["key"]
    node = members.get(ident[:TOKEN_BYTES])
    if node is None:
        why = (left or {}).get(ident[:TOKEN_BYTES])
        if why is not None:
            raise ProtocolError(f"{op.name} key {key} refused: {why}")
        raise ProtocolError(f"{op.name} key {key}: this connection belongs to no worker "
                            f"of this job")
    claimed = header.get("node", node)
    if op in (Op.REGISTER, Op.PUSH) and claimed != node:
        raise ProtocolError(f"{op.name} key {key} as worker {claimed!r} on a connection "
                            f"of worker {node}")
    if op in (Op.SET_STATE, Op.ABORT) and node != 0 and node != min(members.values()):
        raise ProtocolError(f"{op.name} key {key} from worker {node}: only worker "
                            f"{min(members.values())} " + (
                                "restores the servers' state (load_state_dict)"
                                if op == Op.SET_STATE else "rolls back a skipped step"))


class Waiter(NamedTuple):
    """Who waits for a step's answer: a request's connection, its id and peer address."""

    ident: bytes
    rid: int
    peer: str


class Requests:
    """Serves the requests of one key engine's keys on ``aggregator``; its replies go to
    ``out`` (a ZeroMQ socket), payloads in frames of ``env.frame_bytes``."""

    def __init__(self, aggregator: Aggregator, out: Any, env: ClusterEnv) -> None:
        self.aggregator = aggregator
        self.out = out
        self.env = env

    @property
    def keys(self) -> dict:
        """The keys' states (:class:`~bps.server.aggregator.KeyState`), by key."""
        return self.aggregator.keys

    def serve(self, ident: bytes, header: dict, payload: list | None) -> None:
        """Handle one request; a refusal or a failure becomes its ERROR reply."""
        try:
            self.handle(ident, header, payload)
        except RequestError as exc:
            self._error(Waiter(ident, header["rid"], header.get("peer", "?")),
                        header["op"], str(exc))
        except Exception as exc:  # a codec failure must not kill the server
            log.exception("key %s: %s failed", header.get("key"), header["op"].name)
            self._error(Waiter(ident, header["rid"], header.get("peer", "?")), header["op"],
                        f"key {header.get('key')}: {header['op'].name} failed: "
                        f"{type(exc).__name__}: {exc}")

    def handle(self, ident: bytes, header: dict, payload: list | None) -> None:
        """Handle one request (``payload``: its frames, or None); its replies are sent
        by the time this returns. Raises RequestError where it is refused."""
        op, key, rid = header["op"], header["key"], header["rid"]
        sums = self.aggregator
        if op == Op.REGISTER:
            self._register(header)
            self._reply(ident, encode(Op.OK, rid=rid))
        elif op == Op.PUSH:
            self._push(ident, header, payload)
        elif op == Op.PULL:
            answer = sums.pull(key, header["step"],
                               Waiter(ident, rid, header.get("peer", "?")))
            if answer is not None:
                self._send(answer)
        elif op == Op.GET_STATE:
            step, blob = sums.get_state(key)
            self._reply(ident, encode(Op.DATA, rid=rid, key=key, step=step,
                                      nbytes=len(blob)), blob)
        elif op == Op.SET_STATE:
            sums.set_state(key, _buffers(payload))
            self._reply(ident, encode(Op.OK, rid=rid))
        elif op == Op.ABORT:
            sums.abort(key, header["step"])
            self._reply(ident, encode(Op.OK, rid=rid))
        elif op == Op.LAST:
            self._last(header, payload)
            self._reply(ident, encode(Op.OK, rid=rid))

    def _register(self, header: dict) -> None:
        key, numel, name = header["key"], header["numel"], header["name"]
        if not 0 <= key < MAX_KEY:
            raise RequestError(f"key {key} ({name!r}): key out of range [0, 2**63)")
        if not 0 <= numel <= MAX_NUMEL:
            raise RequestError(f"key {key} ({name!r}): numel={numel} out of range")
        try:
            dtype = torch_dtype(header["dtype"])
        except ValueError as exc:
            raise RequestError(f"key {key} ({name!r}): {exc}") from None
        limit = self.env.max_message_bytes
        largest = (limit - 64) // 2
        if numel * dtype.itemsize > largest:
            raise RequestError(f"key {key} ({name!r}): numel={numel} ({numel * dtype.itemsize} "
                               f"bytes) is larger than a key may be ({largest} bytes: half of "
                               f"BPS_MAX_MESSAGE_BYTES={limit})")
        new = key not in self.aggregator.keys
        self.aggregator.register(key, numel, dtype, header["params"], name, header["node"])
        if new:
            load_soon(header["params"], dtype)  # numba's start-up, beside the rendezvous

    def _push(self, ident: bytes, header: dict, payload: list | None) -> None:
        """Check a push's fields against its key's declaration, then sum it: its ACK
        (added, or held), then the answers of the steps it completed."""
        state = self.aggregator.key(header["key"])
        node = header["node"]
        if header["dtype"] != dtype_name(state.dtype):
            raise RequestError(f"{state.where}: push dtype {header['dtype']!r} differs from the "
                               f"declared {dtype_name(state.dtype)!r}")
        if header["numel"] != state.numel:
            raise RequestError(f"{state.where}: push numel {header['numel']} differs from the "
                               f"declared {state.numel}")
        if not 0 <= node < self.aggregator.workers:
            raise RequestError(f"{state.where}: field 'node'={node} out of range")
        if header["lr"] < 0:
            raise RequestError(f"{state.where}: field 'lr'={header['lr']} is negative")
        raw_bytes = state.numel * state.dtype.itemsize
        if "mark" in header:  # no payload (the protocol checked nbytes == 0)
            pass
        elif state.chain is None and header["nbytes"] != raw_bytes:
            raise RequestError(f"{state.where}: raw payload of {header['nbytes']} bytes, expected "
                               f"{raw_bytes}")
        if state.chain is not None and header["nbytes"] > 2 * raw_bytes + 64:
            raise RequestError(f"{state.where}: compressed payload of {header['nbytes']} bytes is "
                               "larger than any encoding")
        pushed = self.aggregator.push(
            state.key, node, header["step"], _buffers(payload), header["lr"],
            Waiter(ident, header["rid"], header.get("peer", "?")), header.get("mark"),
            header.get("what", ""), header.get("gen", 0))
        for waiter, msg in pushed.refused:  # an earlier push, held: after its ACK
            self._error(waiter, Op.PUSH, msg)
        self._reply(ident, encode(Op.ACK, rid=header["rid"]))  # added, or held
        for answer in pushed.finished:
            self._send(answer)

    def _last(self, header: dict, payload: list | None) -> None:
        """A worker's last answer of the key from the server this one replaced
        (:meth:`Aggregator.restore`); a step it completes is answered."""
        state = self.aggregator.key(header["key"])
        skip, nbytes = header["skip"], header["nbytes"]
        raw_bytes = state.numel * state.dtype.itemsize
        if skip is not None and (nbytes or not isinstance(skip.get("skip"), str)):
            raise RequestError(f"{state.where}: LAST: a skip has field 'skip' and no payload")
        if skip is None and (nbytes != raw_bytes if state.chain is None
                             else nbytes > 2 * raw_bytes + 64):
            raise RequestError(f"{state.where}: LAST: a payload of {nbytes} bytes")
        for answer in self.aggregator.restore(state.key, header["step"], _buffers(payload),
                                              skip):
            self._send(answer)

    def membership(self, generation: int, members: list[int]) -> None:
        """A new membership from the scheduler: the steps it drops or completes are
        answered (:meth:`Aggregator.set_members`)."""
        pushed = self.aggregator.set_members(generation, members)
        for waiter, msg in pushed.refused:
            self._error(waiter, Op.PUSH, msg)
        for answer in pushed.finished:
            self._send(answer)

    def _send(self, answer: Finished) -> None:
        """A finished step's DATA (or the server chain's ERROR) to each of its waiters."""
        if answer.error is not None:
            for waiter in answer.waiters:
                self._send_error(waiter.ident, waiter.rid, answer.error)
            return
        payload = answer.payload.contiguous()
        if payload.dtype != torch.uint8:  # a raw sum (numpy has no bfloat16: a torch view)
            payload = payload.view(torch.uint8)
        body = memoryview(payload.numpy())  # a compressed payload: no torch op, GIL kept
        for waiter in answer.waiters:
            self._reply(waiter.ident, encode(Op.DATA, rid=waiter.rid, key=answer.key,
                                             step=answer.step, nbytes=body.nbytes,
                                             server_s=answer.server_s, **answer.skip), body)

    def _error(self, waiter: Waiter, op: Op, msg: str) -> None:
        msg = error_text(msg)
        refusals.warning("refused %s from %s: %s", op.name, waiter.peer, msg)
        self._send_error(waiter.ident, waiter.rid, msg)

    def _send_error(self, ident: bytes, rid: int, msg: str) -> None:
        """An ERROR reply to request ``rid``; ``msg`` as ``error_text`` bounds it."""
        send_message(self.out, [ident, encode(Op.ERROR, rid=rid, msg=msg)])

    def _reply(self, ident: bytes, header: bytes, payload: Any = None) -> None:
        """Send a reply; ``payload`` (a buffer) in frames of BPS_FRAME_BYTES."""
        frames = [ident, header]
        if payload is not None:
            frames += payload_frames(memoryview(payload), self.env.frame_bytes)
        send_message(self.out, frames, copy=False)


def _buffers(payload: list | None) -> list:
    """A request's payload frames as buffers (views of the frames, which they keep)."""
    return [frame.buffer for frame in payload] if payload else []
