"""The messages between a training process and its node agent (:mod:`bps.worker.agent`).

One stream socket (a ``socketpair``) carries length-prefixed frames; the first byte
names the kind. A push is announced in a few dozen bytes (its values already lie in
shared memory), its completion in ten; calls (declare, barrier, state_dict, ...) and
their replies carry pickles.

    >>> frame = pack_push(7, 3, 0.1, -2, 1.0, None, "")
    >>> kind, body = frame[4], frame[5:]
    >>> kind == PUSH and unpack_push(body)[:2]
    (7, 3)
"""

from __future__ import annotations

import socket
import struct
import threading

HELLO, PUSH, DONE, CALL, REPLY, FATAL = range(6)
# a gradient pipeline the agent runs (bps.core.shared_pipeline): a parameter's gradient
# is in its shared buffer (GRAD), the step is counted (END_STEP); back: a parameter's
# average is in its buffer (GRAD_DONE), every one of the step's is (STEP_DONE), the
# pipeline failed (PIPE_ERROR, a pickled exception)
GRAD, END_STEP, GRAD_DONE, STEP_DONE, PIPE_ERROR = range(6, 11)
JOINED, NOTIFY = 1, 2  # a GRAD's flags: a zero marker travels; answer with GRAD_DONE
# a collective between the node's local ranks (bps.worker.agent_group), and its answer;
# a local rank other than 0 says who it is (JOIN) when it connects
COLL, COLL_DONE, JOIN = range(11, 14)
OK, SKIPPED, FAILED = range(3)  # a DONE's status
MARK_CODES = {None: 0, "nonfinite": 1, "zero": 2}
MARKS = {code: mark for mark, code in MARK_CODES.items()}

_LEN = struct.Struct("<I")
# after the kind byte:
# key step lr priority momentum_scale mark generation (-1: the engine's own)
_PUSH = struct.Struct("<QqdqdBq")
_DONE = struct.Struct("<QB")  # key status
_CALL = struct.Struct("<Q")  # call id (CALL and REPLY)
_GRAD = struct.Struct("<IIBdd")  # pipeline index flags lr momentum_scale
_PIPE = struct.Struct("<II")  # pipeline, index (or applied: END_STEP)


def pack_push(key: int, step: int, lr: float, priority: int, momentum_scale: float,
              mark: str | None, what: str, generation: int | None = None) -> bytes:
    """The frame announcing a push whose values lie in the key's input buffer."""
    body = bytes((PUSH,)) + _PUSH.pack(key, step, lr, priority, momentum_scale,
                                       MARK_CODES[mark], -1 if generation is None
                                       else generation)
    if what:  # the tensor it is part of, for the error that names it
        body += what.encode()
    return _LEN.pack(len(body)) + body


def unpack_push(body: bytes
                ) -> tuple[int, int, float, int, float, str | None, str, int | None]:
    """``(key, step, lr, priority, momentum_scale, mark, what, generation)`` (``body``:
    after the kind)."""
    key, step, lr, priority, scale, mark, generation = _PUSH.unpack_from(body)
    return (key, step, lr, priority, scale, MARKS[mark], body[_PUSH.size:].decode(),
            None if generation < 0 else generation)


def pack_done(key: int, status: int, extra: bytes = b"") -> bytes:
    body = bytes((DONE,)) + _DONE.pack(key, status) + extra
    return _LEN.pack(len(body)) + body


def unpack_done(body: bytes) -> tuple[int, int, bytes]:
    """``(key, status, extra)``."""
    key, status = _DONE.unpack_from(body)
    return key, status, body[_DONE.size:]


def pack_call(kind: int, call_id: int, payload: bytes) -> bytes:
    body = bytes((kind,)) + _CALL.pack(call_id) + payload
    return _LEN.pack(len(body)) + body


def unpack_call(body: bytes) -> tuple[int, bytes]:
    """``(call id, payload)``."""
    (call_id,) = _CALL.unpack_from(body)
    return call_id, body[_CALL.size:]


def grad_record(pipe: int, index: int, flags: int, lr: float, scale: float) -> bytes:
    """One parameter's announcement, for :func:`pack_grads`."""
    return _GRAD.pack(pipe, index, flags, lr, scale)


def pack_grads(records: list[bytes]) -> bytes:
    """One GRAD frame announcing one parameter or several (:func:`grad_record` each):
    several are the members of a bucket, which the agent pushes together.

        >>> unpack_grads(pack_grads([grad_record(1, 3, 0, 0.5, 1.0),
        ...                          grad_record(1, 4, NOTIFY, 0.5, 1.0)])[5:])
        [(1, 3, 0, 0.5, 1.0), (1, 4, 2, 0.5, 1.0)]
    """
    body = b"".join(records)
    return _LEN.pack(len(body) + 1) + bytes((GRAD,)) + body


def unpack_grads(body: bytes) -> list[tuple[int, int, int, float, float]]:
    """``(pipeline, index, flags, lr, momentum_scale)`` of each parameter of a GRAD;
    ValueError where the body is not whole records."""
    if not body or len(body) % _GRAD.size:
        raise ValueError(f"a GRAD frame of {len(body)} bytes: not whole announcements "
                         f"of {_GRAD.size} bytes")
    return list(_GRAD.iter_unpack(body))


def pack_pipe(kind: int, pipe: int, index: int = 0, extra: bytes = b"") -> bytes:
    """END_STEP (``index``: 1 where the step was applied), GRAD_DONE, STEP_DONE or
    PIPE_ERROR (``extra``: the pickled exception) of pipeline ``pipe``."""
    body = bytes((kind,)) + _PIPE.pack(pipe, index) + extra
    return _LEN.pack(len(body)) + body


def unpack_pipe(body: bytes) -> tuple[int, int, bytes]:
    """``(pipeline, index, extra)``."""
    pipe, index = _PIPE.unpack_from(body)
    return pipe, index, body[_PIPE.size:]


def pack(kind: int, payload: bytes) -> bytes:
    body = bytes([kind]) + payload
    return _LEN.pack(len(body)) + body


class Link:
    """One end of the socket: whole frames out (any thread), whole frames in (one thread
    at a time: :meth:`recv` blocks, :meth:`recv_available` does not).

        >>> a, b = (Link(s) for s in socket.socketpair())
        >>> a.send(pack(HELLO, b"hi")); a.send(pack(FATAL, b"")); a.close()
        >>> b.recv_available()
        [(0, b'hi'), (5, b'')]
        >>> b.recv_available() is None       # the end of the stream
        True
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._buffer = bytearray()  # bytes read: whole frames taken up to _start
        self._start = 0

    def send(self, frame: bytes) -> None:
        with self._lock:
            self.sock.sendall(frame)

    def recv(self) -> tuple[int, bytes] | None:
        """``(kind, body after the kind)``, or None at the end of the stream."""
        while True:
            frames = self._whole(1)
            if frames:
                return frames[0]
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self._buffer += data

    def recv_available(self) -> list[tuple[int, bytes]] | None:
        """The whole frames that arrived (perhaps none), without waiting; None at the
        end of the stream (OSError where the peer reset it)."""
        try:
            data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        if not data:
            return None
        self._buffer += data
        return self._whole()

    def _whole(self, most: int = -1) -> list[tuple[int, bytes]]:
        """Up to ``most`` (-1: every) whole frames off the front of the buffer."""
        frames, buffer, start = [], self._buffer, self._start
        while len(frames) != most and len(buffer) - start >= 4:
            (length,) = _LEN.unpack_from(buffer, start)
            if len(buffer) - start - 4 < length:
                break
            body = bytes(buffer[start + 4:start + 4 + length])
            frames.append((body[0], body[1:]))
            start += 4 + length
        if start == len(buffer):
            buffer.clear()
            start = 0
        elif start > 1 << 15:
            del buffer[:start]
            start = 0
        self._start = start
        return frames

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
