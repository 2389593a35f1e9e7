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
              wire.pack_push(3, 0, 1e-3, 0, 1.0, None, "fc.bias", generation=2),
              wire.pack_done(9, wire.SKIPPED, b"why"),
              wire.pack_call(wire.CALL, 41, big),
              wire.pack(wire.FATAL, b"ValueError: boom")]
    thread = threading.Thread(target=lambda: [sender.send(f) for f in frames])
    thread.start()  # the big frame blocks until it is read
    got = [receiver.recv() for _ in frames]
    thread.join(timeout=10)
    assert got[0][0] == wire.PUSH
    assert wire.unpack_push(got[0][1]) == (2**63 - 1, 12, 0.125, -7, 0.5, "nonfinite",
                                           "fc.weight", None)
    assert wire.unpack_push(got[1][1]) == (3, 0, 1e-3, 0, 1.0, None, "fc.bias", 2)
    assert got[2][0] == wire.DONE and wire.unpack_done(got[2][1]) == (9, wire.SKIPPED, b"why")
    assert got[3][0] == wire.CALL and wire.unpack_call(got[3][1]) == (41, big)
    assert got[4] == (wire.FATAL, b"ValueError: boom")
    sender.close()
    assert receiver.recv() is None  # the end of the stream
    receiver.close()


def test_frames_cut_anywhere_come_out_whole_without_waiting():
    """recv_available returns only whole frames, whatever bytes have arrived (a frame
    cut in its length, its kind or its body waits for the rest), never blocks, and then
    recv goes on from the same buffer."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = wire.Link(theirs)
    frames = [wire.pack_grads([wire.grad_record(1, i, wire.NOTIFY, 0.5, 1.0)])
              for i in range(3)]
    frames.append(wire.pack(wire.FATAL, b"x" * 100_000))  # larger than one read
    stream = b"".join(frames)
    got = []
    cuts = [2, 4, 5, len(frames[0]) + 7, len(stream) - 1, len(stream)]
    for start, end in zip([0, *cuts[:-1]], cuts, strict=True):
        mine.sendall(stream[start:end])
        for _ in range(8):  # what arrived, read 64 KiB at a time
            got += receiver.recv_available()
        if end < len(stream):
            assert len(got) < len(frames)  # the frame cut at ``end`` is not out yet
    assert receiver.recv_available() == []  # nothing waiting: no block, no frame
    assert [kind for kind, _ in got] == [wire.GRAD] * 3 + [wire.FATAL]
    assert [wire.unpack_grads(body)[0][1] for _, body in got[:3]] == [0, 1, 2]
    assert got[3][1] == b"x" * 100_000
    mine.sendall(wire.pack(wire.HELLO, b"then"))
    assert receiver.recv() == (wire.HELLO, b"then")
    mine.close()
    assert receiver.recv_available() is None  # the end of the stream
    receiver.close()
