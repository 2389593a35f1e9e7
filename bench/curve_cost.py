"""What CURVE costs per byte: libsodium's cipher alone, and ZeroMQ with and without it.

Usage::

    .venv/bin/python bench/curve_cost.py [--mbytes 200] [--rounds 5]

1. libsodium's ``crypto_box_easy_afternm`` / ``crypto_box_open_easy_afternm``
   (XSalsa20-Poly1305, what a CURVE connection runs per message frame), called through
   ctypes on the libsodium that pyzmq bundles, against a plain memory copy of the same
   bytes (numpy): MB/s at several message sizes on one core.
2. ZeroMQ one way: a DEALER sends ``--mbytes`` MB in frames of each size to a ROUTER in
   another context of the same process (each context one I/O thread: the sender's
   encrypts, the receiver's decrypts), plain TCP and CURVE over loopback.

Rounds alternate plain and CURVE; medians are printed as a markdown table and written to
bench/results/curve_cost.json (``--heap``: curve_cost_heap.json).

``--libsodium PATH [PATH ...]``: instead, only the cipher of each given libsodium file
(for example one unpacked from another pyzmq wheel's ``pyzmq.libs/``) at 4 MB messages,
to compare builds on one host::

    .venv/bin/python bench/curve_cost.py --libsodium /tmp/pyzmq-27.2.0/pyzmq.libs/libsodium*

``--sweep``: instead, messages of one partition (4,096,000 B, as bps sends them) cut
into frames of 64 KiB .. 4 MB (one ZeroMQ multipart message per partition), plain TCP
and CURVE, contexts of 1 and 2 I/O threads, the receiver keeping the zero-copy frames
(``frames``) or reading them into one preallocated buffer with ``recv_into``
(``into``); written to bench/results/curve_sweep.json::

    .venv/bin/python bench/curve_cost.py --sweep --mbytes 100 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import zmq

SIZES = [4096, 65536, 1 << 20, 4096000]  # 4096000: BYTEPS_PARTITION_BYTES of ps_throughput


def libsodium(path: str | None = None) -> ctypes.CDLL:
    """The libsodium at ``path``, by default the one pyzmq's libzmq links against."""
    if path is None:
        libs = Path(zmq.__file__).parent.parent / "pyzmq.libs"
        found = sorted(glob.glob(str(libs / "libsodium*.so*")))
        path = found[0] if found else "libsodium.so"
    sodium = ctypes.CDLL(path)
    if sodium.sodium_init() < 0:
        raise RuntimeError("sodium_init failed")
    return sodium


def cipher_mb_s(sodium: ctypes.CDLL, size: int, mbytes: int) -> tuple[float, float, float]:
    """(encrypt, decrypt, memcpy) MB/s for ``mbytes`` MB in messages of ``size`` bytes."""
    count = max(1, mbytes * 1_000_000 // size)
    key = ctypes.create_string_buffer(32)
    pk, sk = ctypes.create_string_buffer(32), ctypes.create_string_buffer(32)
    sodium.crypto_box_keypair(pk, sk)
    sodium.crypto_box_beforenm(key, pk, sk)
    nonce = ctypes.create_string_buffer(24)
    plain = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    boxed = np.empty(size + 16, dtype=np.uint8)
    opened = np.empty(size, dtype=np.uint8)
    p, b, o = (ctypes.c_void_p(a.ctypes.data) for a in (plain, boxed, opened))
    start = time.perf_counter()
    for _ in range(count):
        sodium.crypto_box_easy_afternm(b, p, ctypes.c_ulonglong(size), nonce, key)
    enc = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(count):
        if sodium.crypto_box_open_easy_afternm(o, b, ctypes.c_ulonglong(size + 16), nonce,
                                               key) != 0:
            raise RuntimeError("decryption failed")
    dec = time.perf_counter() - start
    assert np.array_equal(opened, plain)
    start = time.perf_counter()
    for _ in range(count):
        np.copyto(opened, plain)
    copy = time.perf_counter() - start
    moved = count * size / 1e6
    return moved / enc, moved / dec, moved / copy


def zmq_mb_s(size: int, mbytes: int, curve: bool, transport: str = "tcp") -> float:
    """One-way MB/s of ``mbytes`` MB in frames of ``size`` bytes over loopback TCP or a
    Unix domain socket (``transport="ipc"``)."""
    return zmq_message_mb_s(size, size, mbytes, curve, io_threads=1, receive="frames",
                            transport=transport)[0]


SWEEP_FRAMES = [65536, 131072, 262144, 524288, 1 << 20, 2 << 20, 4096000]


def zmq_message_mb_s(message: int, frame: int, mbytes: int, curve: bool, io_threads: int,
                     receive: str, transport: str = "tcp") -> tuple[float, float]:
    """(MB/s, CPU seconds per GB) one way, ``mbytes`` MB in messages of ``message`` bytes,
    each a multipart message of frames of at most ``frame`` bytes. ``receive``:
    ``"frames"`` keeps each frame (zero-copy), ``"into"`` reads the frames into one
    preallocated buffer. The CPU time (this process: both sockets' I/O threads and the
    Python threads, user + system) depends much less on other load than the wall time."""
    count = max(1, mbytes * 1_000_000 // message)
    rx_ctx, tx_ctx = zmq.Context(io_threads=io_threads), zmq.Context(io_threads=io_threads)
    rx, tx = rx_ctx.socket(zmq.ROUTER), tx_ctx.socket(zmq.DEALER)
    for sock in (rx, tx):
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.LINGER, 0)
    if curve:
        public, secret = zmq.curve_keypair()
        rx.curve_server = True
        rx.curve_secretkey = secret
        tx.curve_serverkey = public
        tx.curve_publickey, tx.curve_secretkey = zmq.curve_keypair()
    if transport == "ipc":  # an abstract Unix socket: no file, gone with the socket
        address = f"ipc://@bps-curve-cost-{os.getpid()}-{threading.get_ident()}"
        rx.bind(address)
    else:
        address = f"tcp://127.0.0.1:{rx.bind_to_random_port('tcp://127.0.0.1')}"
    tx.connect(address)
    tx.send(b"hello")  # the handshake is not timed
    if not rx.poll(30_000):
        raise RuntimeError("no connection")
    rx.recv_multipart()
    payload = memoryview(np.random.default_rng(1).integers(0, 255, message, dtype=np.uint8))
    parts = [payload[i:i + frame] for i in range(0, message, frame)]
    into = memoryview(np.empty(message, dtype=np.uint8))
    done = threading.Event()

    def receive_all() -> None:
        for _ in range(count):
            if not rx.poll(60_000):
                raise RuntimeError("receiver: no frame for 60 s")
            if receive == "frames":
                rx.recv_multipart(copy=False)
                continue
            rx.recv()  # the routing id
            offset = 0
            while rx.getsockopt(zmq.RCVMORE):
                offset += rx.recv_into(into[offset:])
            assert offset == message
        done.set()

    thread = threading.Thread(target=receive_all)
    cpu = time.process_time()
    start = time.perf_counter()
    thread.start()
    for _ in range(count):
        tx.send_multipart(parts, copy=False)
    thread.join(timeout=300)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    if not done.is_set():
        raise RuntimeError("receiver did not finish")
    rx.close()
    tx.close()
    rx_ctx.term()
    tx_ctx.term()
    return count * message / 1e6 / elapsed, cpu / (count * message / 1e9)


def sweep(mbytes: int, rounds: int) -> None:
    """The ``--sweep`` table: frame size x I/O threads x receive mode, plain and CURVE."""
    message = SIZES[-1]
    configs = [(frame, io, recv) for frame in SWEEP_FRAMES for io in (1, 2)
               for recv in ("frames", "into")]
    runs: dict[str, list[float]] = {}
    load = [os.getloadavg()[0]]
    for _ in range(rounds):
        for frame, io, recv in configs:
            for curve in (False, True):
                name = f"{frame}/{io}/{recv}/{'curve' if curve else 'plain'}"
                mb_s, cpu = zmq_message_mb_s(message, frame, mbytes, curve, io, recv)
                runs.setdefault(name, []).append(mb_s)
                runs.setdefault(name + "/cpu", []).append(cpu)
    load.append(os.getloadavg()[0])
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(f"messages of {message} B, median of {rounds} rounds, {mbytes} MB per run, load "
          f"average {load[0]:.1f} -> {load[1]:.1f}\n")
    print("| frame size | I/O threads | receive | plain TCP | CURVE | CURVE / plain "
          "| CPU s/GB plain | CPU s/GB CURVE |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for frame, io, recv in configs:
        m = {k: medians[f"{frame}/{io}/{recv}/{k}"]
             for k in ("plain", "curve", "plain/cpu", "curve/cpu")}
        print(f"| {frame} B | {io} | {recv} | {m['plain']:.0f} MB/s | {m['curve']:.0f} MB/s "
              f"| {m['curve'] / m['plain']:.2f} | {m['plain/cpu']:.2f} "
              f"| {m['curve/cpu']:.2f} |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "curve_sweep.json").write_text(json.dumps({"runs": runs, "medians": medians},
                                                     indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbytes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--heap", action="store_true",
                        help="tune glibc malloc as bps servers and workers do "
                             "(bps.common.memory.keep_buffers_in_heap) before any socket")
    parser.add_argument("--sweep", action="store_true",
                        help="frame sizes x I/O threads x receive mode (see the docstring)")
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp",
                        help="ZeroMQ over loopback TCP or a Unix domain socket")
    parser.add_argument("--libsodium", nargs="+", metavar="PATH",
                        help="only the cipher of these libsodium files (see the docstring)")
    args = parser.parse_args()
    if args.libsodium:
        print(f"4,096,000 B messages, {args.mbytes} MB, median of {args.rounds}, one core\n\n"
              "| libsodium | encrypt | decrypt |\n|---|---:|---:|")
        for path in args.libsodium:
            runs = [cipher_mb_s(libsodium(path), SIZES[-1], args.mbytes)
                    for _ in range(args.rounds)]
            enc, dec = (statistics.median(r[i] for r in runs) for i in (0, 1))
            print(f"| {path} | {enc:.0f} MB/s | {dec:.0f} MB/s |")
        return
    if args.sweep:
        sweep(args.mbytes, args.rounds)
        return
    if args.heap:
        from bps.common.memory import keep_buffers_in_heap

        keep_buffers_in_heap()
    sodium = libsodium()
    rows = {}
    for size in SIZES:
        runs: dict[str, list[float]] = {k: [] for k in ("enc", "dec", "copy", "plain", "curve")}
        for _ in range(args.rounds):
            enc, dec, copy = cipher_mb_s(sodium, size, args.mbytes // 2)
            runs["enc"].append(enc)
            runs["dec"].append(dec)
            runs["copy"].append(copy)
            runs["plain"].append(zmq_mb_s(size, args.mbytes, False, args.transport))
            runs["curve"].append(zmq_mb_s(size, args.mbytes, True, args.transport))
        rows[size] = {k: statistics.median(v) for k, v in runs.items()} | {"runs": runs}
    print(f"median of {args.rounds} alternating rounds, {args.mbytes} MB per ZeroMQ run, "
          f"malloc {'tuned' if args.heap else 'default'}, {args.transport}, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print(f"| frame size | libsodium encrypt | libsodium decrypt | memcpy | ZeroMQ plain "
          f"{args.transport} | ZeroMQ CURVE | CURVE / plain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, r in rows.items():
        print(f"| {size} B | {r['enc']:.0f} MB/s | {r['dec']:.0f} MB/s | {r['copy']:.0f} MB/s "
              f"| {r['plain']:.0f} MB/s | {r['curve']:.0f} MB/s | {r['curve'] / r['plain']:.2f} |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    name = "curve_cost_heap.json" if args.heap else "curve_cost.json"
    if args.transport != "tcp":
        name = name.replace(".json", f"_{args.transport}.json")
    (out / name).write_text(json.dumps({str(k): v for k, v in rows.items()}, indent=2))


if __name__ == "__main__":
    main()
