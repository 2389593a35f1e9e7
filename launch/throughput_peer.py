"""The two ends of a throughput measurement, run inside the emulated hosts.

``python -m bps.launch.throughput_peer receive HOST TIMEOUT`` listens on a free port
of HOST, prints the port, reads one connection to its end and prints
``{"bytes": ..., "seconds": ...}`` measured from its first to its last chunk (the
first chunk's bytes excluded). ``python -m bps.launch.throughput_peer send HOST PORT
NBYTES TIMEOUT`` sends NBYTES zero bytes to it.
:func:`bps.launch.throughput.measure_throughput` starts both.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def receive(host: str, timeout: float) -> dict:
    """Accept one connection on a free port of ``host`` (printed first) and time it."""
    server = socket.create_server((host, 0))
    print(server.getsockname()[1], flush=True)
    server.settimeout(timeout)
    conn, _ = server.accept()
    conn.settimeout(timeout)
    total, first, last, first_len = 0, None, None, 0
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        now = time.perf_counter()
        if first is None:
            first, first_len = now, len(chunk)
        total, last = total + len(chunk), now
    return {"bytes": total - first_len, "seconds": last - first}


def send(host: str, port: int, nbytes: int, timeout: float) -> None:
    """Send ``nbytes`` zero bytes over one TCP connection to ``host:port``."""
    conn = socket.create_connection((host, port), timeout=timeout)
    block = bytes(1 << 16)
    left = nbytes
    while left > 0:
        conn.sendall(block[:min(left, len(block))])
        left -= len(block)
    conn.close()


def main(argv: list[str]) -> int:
    if argv[:1] == ["receive"] and len(argv) == 3:
        print(json.dumps(receive(argv[1], float(argv[2]))), flush=True)
        return 0
    if argv[:1] == ["send"] and len(argv) == 5:
        send(argv[1], int(argv[2]), int(argv[3]), float(argv[4]))
        return 0
    print("usage: throughput_peer receive HOST TIMEOUT | send HOST PORT NBYTES TIMEOUT",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
