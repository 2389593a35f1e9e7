"""bps.worker.agent_wire: the frames between a training process and its node agent come
out as they went in, over a real socket pair, whatever their size."""

from __future__ import annotations

import doctest
import socket
import threading

from bps.worker import agent_wire as wire


def test_the_module_examples_run():
    assert doctest.testmod(wire).failed == 0


def test_frames_round_trip_over_a_socket_pair():
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = wire.Link(mine), wire.Link(theirs)
    big = bytes(range(256)) * 8192  # 2 MiB: more than a socket buffer holds
    frames = [wire.pack_push(2**63 - 1, 12, 0.125, -7, 0.5, "nonfinite", "fc.weight"),
              wire.pack_push(3, 0, 1e-3, 0, 1.0, None, "fc.bias"),
              wire.pack_done(9, wire.SKIPPED, b"why"),
              wire.pack_call(wire.CALL, 41, big),
              wire.pack(wire.FATAL, b"ValueError: boom")]
    thread = threading.Thread(target=lambda: [sender.send(f) for f in frames])
    thread.start()  # the big frame blocks until it is read
    got = [receiver.recv() for _ in frames]
    thread.join(timeout=10)
    assert got[0][0] == wire.PUSH
    assert wire.unpack_push(got[0][1]) == (2**63 - 1, 12, 0.125, -7, 0.5, "nonfinite",
                                           "fc.weight")
    assert wire.unpack_push(got[1][1]) == (3, 0, 1e-3, 0, 1.0, None, "fc.bias")
    assert got[2][0] == wire.DONE and wire.unpack_done(got[2][1]) == (9, wire.SKIPPED, b"why")
    assert got[3][0] == wire.CALL and wire.unpack_call(got[3][1]) == (41, big)
    assert got[4] == (wire.FATAL, b"ValueError: boom")
    sender.close()
    assert receiver.recv() is None  # the end of the stream
    receiver.close()
