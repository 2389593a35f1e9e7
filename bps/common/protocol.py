"""The wire protocol: a msgpack header frame, then the payload in zero or more frames.

Every message is a ZeroMQ multipart message ``[header, payload frames...]`` (a ROUTER
socket sees the peer identity in front). The header is a msgpack map; ``encode`` writes
it, ``decode`` checks the protocol version, the op and the type of every field the op
needs, raising :class:`ProtocolError` naming the field. Checks against a key's
registration (numel, dtype, sizes) are the server's job.

A payload of ``nbytes`` bytes (``PUSH``, ``SET_STATE``, ``DATA``) travels as one frame,
or cut into frames of F bytes each but the last (1 .. F bytes), F >= ``MIN_FRAME_BYTES``:
``ceil(nbytes / F)`` frames (``payload_frames``; the sender picks F, ``BPS_FRAME_BYTES``).
libzmq's CURVE encrypts each frame on its own and runs faster on frames of ~128 KiB
than on 4 MB ones. ``check_payload`` refuses any other layout naming the field, and
``join_frames`` puts the frames back into one buffer::

    frames = payload_frames(memoryview(body), 131072)    # -> [header, *frames] on the wire
    check_payload("PUSH key 3", nbytes, [len(f) for f in frames])
    joined = join_frames(frames)                         # numpy uint8, one copy

Usage::

    from bps.common.protocol import Op, encode, decode
    frame = encode(Op.PUSH, rid=7, key=3, step=0, node=1, dtype="float32",
                   numel=10, nbytes=40, lr=0.1)
    header = decode(frame)            # -> dict, header["op"] == Op.PUSH

Worker <-> server ops (the reply echoes ``rid``):

* ``REGISTER`` key numel dtype name params -> ``OK`` or ``ERROR``
* ``PUSH`` key step node dtype numel nbytes lr + payload -> ``ACK`` as soon as it is
  summed (frees the worker's send credit), then ``DATA`` (the step's aggregate, sent
  once every worker node pushed that step); or ``ERROR``
* ``PULL`` key step -> ``DATA`` of that step (the last completed one or a pending one)
* A step's ``DATA`` carries ``server_s``: the seconds the server spent decoding, summing
  and re-encoding that step of the key (``server_seconds`` reads it; a reader may ignore
  it).
* A ``PUSH`` may carry ``mark``: ``"nonfinite"`` (the worker's gradient has inf or NaN
  entries; ``what`` names it) or ``"zero"`` (a worker that joined contributes nothing),
  with an empty payload. A step of a key with a non-finite mark, or with nothing but
  zero marks, is not summed: its ``DATA`` has ``nbytes`` 0 and ``skip`` (the mark),
  ``skip_node`` and ``skip_what``, and the server chain's state does not change.
* A ``PUSH`` may carry ``gen``: the membership generation its worker divided by (absent:
  0, the job's first). A step holding a push of an older generation than the server's
  is dropped: its ``DATA`` has ``skip`` ``"membership"``, with ``generation`` and
  ``members`` (the worker node ids present) of the server's membership.
* ``ABORT`` key step -> ``OK``: the step is skipped after all (another key had a
  non-finite mark); the server chain returns to its state before that step.
* ``GET_STATE`` key -> ``DATA`` (msgpack of the server chain's state) ; ``SET_STATE``
  key + payload -> ``OK``
* ``LAST`` key step skip + payload -> ``OK``: to a server that replaced a dead one, the
  last answer (``DATA``) of the key this worker got from the dead one, its step, and its
  skip fields (a map, or nil) with no payload where it was a skip. A worker that missed
  that answer and pushes that step again gets it.

Node <-> scheduler ops: ``HELLO`` role worker_id addr token (a server's also
``endpoints``: its addresses, one per ZeroMQ I/O thread; optional ``num_workers``,
``num_servers``: the node's settings, checked against the scheduler's) -> ``WELCOME`` (after
everyone arrived: node_id, servers, endpoints (per server), num_workers, num_servers,
seed, members: the servers get the workers' tokens in node order); ``HEARTBEAT``
both ways (a worker's carries ``step``, the highest step it pushed); ``BARRIER`` seq
step -> ``RELEASE``; ``FINALIZE`` step -> ``BYE``; ``FAILED`` msg (a node gives up: an
exception, a signal, an exit without ``bps.shutdown()``); scheduler -> servers
``SHUTDOWN``; scheduler -> everyone ``PEER_DEAD`` (msg names the dead or failed
process) and ``ERROR``; with ``BPS_MIN_WORKERS``, scheduler -> everyone ``MEMBERSHIP``
generation members msg: worker nodes left (``msg`` names who and why), ``members`` the
worker node ids present from generation ``generation`` on (0 is the job's first; each
change adds one). With ``BPS_SPARE_SERVERS``, scheduler -> a server that registers while
every slot is held ``STANDBY`` (it waits, heartbeating, as a spare); a server that takes a
dead server's slot gets ``WELCOME`` with ``generation`` and ``present`` (the worker node
ids present), the other servers ``MEMBERSHIP`` (the same members, the next generation)
and the workers ``REPLACED`` server addr endpoints generation msg: server slot ``server``
is served from ``addr`` (``endpoints``: one per I/O thread) from membership
``generation`` on.

Joining (``BPS_MIN_WORKERS``; docs/runtime.md, "Elastic membership"): a worker whose
HELLO comes after the rendezvous, for a node id not present, gets ``WELCOME`` with
``joining`` true at once; it is not a member yet. Its ``JOIN`` admits it: everyone else
gets ``MEMBERSHIP`` with the next generation, the members with it, and ``joined``
``[[node, token]]`` (the servers take its token); once every server has answered
with a ``HEARTBEAT`` carrying that ``generation``, the joiner gets ``JOIN`` back with
``generation``, ``members`` and ``source`` (the node that sends it the state). The
source, at its next step boundary, sends the training state in ``STATE`` chunks
(``generation`` it saw, ``offset``, ``total``, ``data`` of at most
:data:`STATE_CHUNK` bytes), each answered by an empty ``STATE`` of that offset; the
joiner asks for the chunks with ``FETCH`` generation offset and gets ``STATE`` back
(the first state sent for that generation or a later one) once all of it arrived.

A worker's token (16 random bytes, first byte non-zero) is the prefix of the ZeroMQ
routing id of every connection it opens to a server: a server takes a request from a
connection as that worker's only when the prefix is the token the scheduler handed out
for it (:data:`TOKEN_BYTES`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 2
TOKEN_BYTES = 16
MAX_HEADER_BYTES = 1 << 20
MIN_FRAME_BYTES = 4096  # the frames of a payload cut into several: at least this each
_SNDMORE = 2  # ZMQ_SNDMORE, fixed by libzmq's API (pyzmq is imported only where needed)
_MISSING = object()


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the message names the field."""


class Op(IntEnum):
    OK = 1
    ERROR = 2
    DATA = 3
    ACK = 4
    REGISTER = 10
    PUSH = 11
    PULL = 12
    GET_STATE = 13
    SET_STATE = 14
    ABORT = 15
    HELLO = 20
    WELCOME = 21
    HEARTBEAT = 22
    BARRIER = 23
    RELEASE = 24
    FINALIZE = 25
    BYE = 26
    SHUTDOWN = 27
    PEER_DEAD = 28
    FAILED = 29
    MEMBERSHIP = 30
    JOIN = 31
    STATE = 32
    FETCH = 33
    STANDBY = 40
    REPLACED = 41
    LAST = 42


_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_BYTES = (bytes,)
_OPT_DICT = (dict, type(None))

# field -> accepted types, per op; a missing or mistyped field is a ProtocolError
FIELDS: dict[Op, dict[str, tuple[type, ...]]] = {
    Op.OK: {"rid": _INT},
    Op.ERROR: {"rid": _INT, "msg": _STR},
    Op.DATA: {"rid": _INT, "key": _INT, "step": _INT, "nbytes": _INT},
    Op.ACK: {"rid": _INT},
    Op.REGISTER: {"rid": _INT, "key": _INT, "numel": _INT, "dtype": _STR, "name": _STR,
                  "params": _OPT_DICT, "node": _INT},
    Op.PUSH: {"rid": _INT, "key": _INT, "step": _INT, "node": _INT, "dtype": _STR,
              "numel": _INT, "nbytes": _INT, "lr": _NUM},
    Op.PULL: {"rid": _INT, "key": _INT, "step": _INT},
    Op.GET_STATE: {"rid": _INT, "key": _INT},
    Op.SET_STATE: {"rid": _INT, "key": _INT, "nbytes": _INT},
    Op.ABORT: {"rid": _INT, "key": _INT, "step": _INT},
    Op.HELLO: {"role": _STR, "worker_id": _INT, "addr": _STR, "token": _BYTES},
    Op.WELCOME: {"node_id": _INT, "servers": (list,), "num_workers": _INT,
                 "num_servers": _INT, "seed": _INT, "members": (list,)},
    Op.HEARTBEAT: {},
    Op.BARRIER: {"seq": _INT, "step": _INT},
    Op.RELEASE: {"seq": _INT},
    Op.FINALIZE: {"step": _INT},
    Op.BYE: {},
    Op.SHUTDOWN: {},
    Op.PEER_DEAD: {"msg": _STR},
    Op.FAILED: {"msg": _STR},
    Op.MEMBERSHIP: {"generation": _INT, "members": (list,), "msg": _STR},
    Op.JOIN: {},
    Op.STATE: {"generation": _INT, "offset": _INT, "total": _INT, "data": _BYTES},
    Op.FETCH: {"generation": _INT, "offset": _INT},
    Op.STANDBY: {},
    Op.LAST: {"rid": _INT, "key": _INT, "step": _INT, "nbytes": _INT, "skip": _OPT_DICT},
    Op.REPLACED: {"server": _INT, "addr": _STR, "endpoints": (list,), "generation": _INT,
                  "msg": _STR},
}

STATE_CHUNK = 256 << 10  # bytes of a joining node's state per STATE message

MARKS = ("nonfinite", "zero")  # a PUSH's optional ``mark``


def server_seconds(header: dict) -> float:
    """A ``DATA`` header's optional ``server_s``; 0.0 where it is absent or not a finite
    number >= 0.

        >>> server_seconds({"server_s": 0.25}), server_seconds({})
        (0.25, 0.0)
    """
    value = header.get("server_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value) if 0 <= value < math.inf else 0.0

DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")


def torch_dtype(name: str) -> Any:
    """``"float32"`` -> ``torch.float32``; raises ValueError for unsupported names."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} not one of {', '.join(DTYPE_NAMES)}")
    import torch  # lazily: the scheduler never needs torch

    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``; raises ValueError for unsupported dtypes."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} not supported: expected one of "
                         f"{', '.join(DTYPE_NAMES)}")
    return name


MAX_ERROR_CHARS = 1000


def error_text(msg: str) -> str:
    """An ERROR's message as sent and logged: at most MAX_ERROR_CHARS characters (it may
    quote a peer's field values, and a peer must not make the replies it gets large)."""
    return msg if len(msg) <= MAX_ERROR_CHARS else msg[:MAX_ERROR_CHARS] + "..."


_OPS = {int(op): op for op in Op}


def encode(op: Op, **fields: Any) -> bytes:
    """Pack a header frame for ``op`` with ``fields``."""
    fields["v"] = PROTOCOL_VERSION
    fields["op"] = int(op)
    return msgpack.packb(fields, use_bin_type=True)


def decode(frame: bytes | memoryview) -> dict[str, Any]:
    """Unpack and type-check a header frame; raises :class:`ProtocolError`."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"field 'v' (protocol version) is {version!r}, "
                            f"expected {PROTOCOL_VERSION}")
    value = header.get("op")  # a dict, not Op(): Enum's lookup is slow per message
    op = _OPS.get(value) if type(value) is int else None  # a list is not hashable
    if op is None:
        raise ProtocolError(f"field 'op' has unknown value {value!r}")
    header["op"] = op
    for name, types in _FIELD_TYPES[op]:
        value = header.get(name, _MISSING)
        if value is _MISSING:
            raise ProtocolError(f"{op.name}: field {name!r} missing")
        if value is True or value is False or not isinstance(value, types):
            raise ProtocolError(f"{op.name}: field {name!r} has type {type(value).__name__}")
    check = _OP_CHECKS.get(op)
    if check is not None:
        check(header)
    return header


def _check_lr(header: dict[str, Any]) -> None:
    if not math.isfinite(header["lr"]):
        raise ProtocolError(f"{header['op'].name}: field 'lr' is {header['lr']!r}, "
                            "expected finite")


def _check_push(header: dict[str, Any]) -> None:
    _check_lr(header)
    if "gen" in header and (type(header["gen"]) is not int or header["gen"] < 0):
        raise ProtocolError(f"PUSH: field 'gen' is {header['gen']!r}, expected an int >= 0")
    if "mark" in header:
        if header["mark"] not in MARKS or not isinstance(header.get("what", ""), str):
            raise ProtocolError(f"PUSH: field 'mark' is {header['mark']!r}, expected one of "
                                f"{', '.join(MARKS)} (with a str 'what')")
        if header["nbytes"] != 0:
            raise ProtocolError("PUSH: a marked push has no payload, but field 'nbytes' is "
                                f"{header['nbytes']}")


def _check_membership(header: dict[str, Any]) -> None:
    if not all(type(n) is int for n in header["members"]):
        raise ProtocolError("MEMBERSHIP: field 'members' must be a list of worker node ids")
    if not all(isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
               and isinstance(pair[1], bytes) for pair in header.get("joined", [])):
        raise ProtocolError("MEMBERSHIP: field 'joined' must be a list of [node, token]")


def _check_state(header: dict[str, Any]) -> None:
    if not (0 <= header["offset"] <= max(header["total"], 0)
            and len(header["data"]) <= STATE_CHUNK):
        raise ProtocolError(f"STATE: field 'offset' {header['offset']} or 'data' "
                            f"({len(header['data'])} bytes) out of range")


def _check_replaced(header: dict[str, Any]) -> None:
    if not all(isinstance(e, str) for e in header["endpoints"]):
        raise ProtocolError("REPLACED: field 'endpoints' must be a list of addresses")


# each op's fields as (name, types) pairs, and the checks beyond their types: looked up
# once per message
_FIELD_TYPES = {op: tuple(fields.items()) for op, fields in FIELDS.items()}
_OP_CHECKS = {op: _check_lr for op, fields in FIELDS.items() if "lr" in fields}
_OP_CHECKS.update({Op.PUSH: _check_push, Op.MEMBERSHIP: _check_membership,
                   Op.STATE: _check_state, Op.REPLACED: _check_replaced})


def payload_frames(body: memoryview, frame_bytes: int) -> list[memoryview]:
    """The frames that carry ``body``: itself if ``frame_bytes`` is 0 or it fits in one
    frame, else zero-copy slices of ``frame_bytes`` bytes (the last one shorter)."""
    size = body.nbytes
    if frame_bytes <= 0 or size <= frame_bytes:
        return [body]
    if frame_bytes < MIN_FRAME_BYTES:
        raise ValueError(f"frames of {frame_bytes} bytes: at least {MIN_FRAME_BYTES}")
    flat = body.cast("B") if body.format != "B" or body.ndim != 1 else body
    return [flat[start:start + frame_bytes] for start in range(0, size, frame_bytes)]


def check_payload(what: str, nbytes: int, sizes: Sequence[int],
                  limit: int | None = None) -> None:
    """The payload frames' ``sizes`` carry field ``nbytes`` as ``payload_frames`` lays it
    out (one frame; or frames of the first one's size, at least MIN_FRAME_BYTES, the last
    one 1 .. that size); ``limit``: the largest payload accepted. Raises
    :class:`ProtocolError` starting with ``what`` and naming the field."""
    if nbytes < 0 or (limit is not None and nbytes > limit):
        raise ProtocolError(f"{what}: field 'nbytes'={nbytes} out of range [0, {limit}]")
    if len(sizes) <= 1:
        if not sizes:
            raise ProtocolError(f"{what}: 0 payload frames, expected 1")
        if sizes[0] != nbytes:
            raise ProtocolError(f"{what}: field 'nbytes'={nbytes} but the payload has "
                                f"{sizes[0]} bytes")
        return
    frame = sizes[0]
    if frame < MIN_FRAME_BYTES:
        raise ProtocolError(f"{what}: payload frames of {frame} bytes, less than "
                            f"{MIN_FRAME_BYTES} (a payload in several frames)")
    expected = -(-nbytes // frame)
    if len(sizes) != expected:
        raise ProtocolError(f"{what}: {len(sizes)} payload frames, expected {expected} "
                            f"(field 'nbytes'={nbytes} in frames of {frame} bytes)")
    for index, size in enumerate(sizes[1:-1], 1):
        if size != frame:
            raise ProtocolError(f"{what}: payload frame {index} has {size} bytes, expected "
                                f"{frame} (every frame but the last as large as the first)")
    last = nbytes - frame * (expected - 1)
    if sizes[-1] != last:
        raise ProtocolError(f"{what}: field 'nbytes'={nbytes} but the last payload frame "
                            f"has {sizes[-1]} bytes, expected {last}")


def join_frames(frames: Sequence[Any], out: np.ndarray | None = None) -> np.ndarray:
    """The payload of ``frames`` (``zmq.Frame``s or buffers) in one uint8 array: ``out``
    (its bytes, as many as the frames hold) or a new array; one copy."""
    parts = [np.frombuffer(getattr(f, "buffer", f), dtype=np.uint8) for f in frames]
    if out is None:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return np.concatenate(parts, out=out)


class ClusterError(RuntimeError):
    """The cluster cannot go on: a peer died, timed out, or refused a request."""


class PeerFailure(ClusterError):
    """The scheduler reports that another process died or failed (its message names it)."""


class RemoteError(ClusterError):
    """A server or the scheduler answered a request with an error (its message)."""


def new_token() -> bytes:
    """A fresh worker token: :data:`TOKEN_BYTES` random bytes, the first non-zero (ZeroMQ
    reserves routing ids that start with a zero byte)."""
    import secrets

    token = secrets.token_bytes(TOKEN_BYTES)
    return bytes([token[0] | 1]) + token[1:]


def drain(sock: Any, limit: int = 256) -> Iterator[list]:
    """Yield up to ``limit`` messages waiting on ``sock`` (zero-copy frames), never
    blocking. It asks ZMQ_EVENTS before each receive instead of receiving until EAGAIN:
    pyzmq lets go of the GIL in every receive, a failed one too, and taking it back can
    wait for other threads' Python (bench/key_overhead.py --convoy).

        >>> import zmq
        >>> ctx = zmq.Context()
        >>> a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        >>> _ = a.bind("inproc://drain-example"), b.connect("inproc://drain-example")
        >>> for body in (b"1", b"2", b"3"):
        ...     b.send(body)
        >>> [frames[0].bytes for frames in drain(a, limit=2)], len(list(drain(a)))
        ([b'1', b'2'], 1)
        >>> a.close(); b.close(); ctx.term()
    """
    import zmq

    # plain ints: pyzmq's flag enums make an enum object in every ``&`` and ``|``
    events, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
    for _ in range(limit):
        if not sock.getsockopt(events) & pollin:
            return
        frames = [sock.recv(noblock, copy=False)]
        while frames[-1].more:  # the rest of a message is there once its first frame is
            frames.append(sock.recv(noblock, copy=False))
        yield frames


def send_message(sock: Any, frames: Sequence[Any], copy: bool = True) -> None:
    """``sock.send_multipart(frames, copy=copy)`` with plain int flags: pyzmq's makes an
    enum object for each frame's ``SNDMORE | flags``, a Python call per frame.

        >>> import zmq
        >>> ctx = zmq.Context()
        >>> a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        >>> _ = a.bind("inproc://send-message-example"), b.connect("inproc://send-message-example")
        >>> send_message(b, [b"head", b"body"])
        >>> a.recv_multipart()
        [b'head', b'body']
        >>> a.close(); b.close(); ctx.term()
    """
    for frame in frames[:-1]:
        sock.send(frame, _SNDMORE, copy=copy)
    sock.send(frames[-1], 0, copy=copy)


def new_socket(ctx: Any, kind: int) -> Any:
    """A ZeroMQ socket with unlimited queues (a ROUTER drops at its high-water mark; the
    ROUTERs that face peers set their own bounds) and a short linger so closing never
    blocks."""
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 500)
    return sock
