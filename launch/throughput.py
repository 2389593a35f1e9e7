"""TCP throughput between two emulated hosts: checks that a shaped link runs at its rate.

Usage::

    from bps.launch.netns import EmulatedCluster
    from bps.launch.link_shape import LinkShape
    from bps.launch.throughput import measure_throughput

    with EmulatedCluster(["a", "b"], LinkShape.parse("100mbit")) as cluster:
        bits_per_second = measure_throughput(cluster.hosts["a"], cluster.hosts["b"], 10**7)
"""

from __future__ import annotations

import json
import subprocess
import sys

from bps.launch.link_shape import NetnsError
from bps.launch.netns import Host, run_command

PEER = [sys.executable, "-m", "bps.launch.throughput_peer"]


def measure_throughput(src: Host, dst: Host, nbytes: int, timeout: float = 60.0) -> float:
    """Send ``nbytes`` over one TCP connection from ``src`` to ``dst``; returns bit/s.

    The rate is measured at the receiver, from the first to the last chunk it reads.
    """
    receiver = subprocess.Popen(dst.exec_argv([*PEER, "receive", dst.ip, str(timeout)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()  # printed once it listens
        if not port.isdigit():
            raise NetnsError(f"throughput receiver in {dst.netns} did not start: "
                             f"{receiver.stderr.read().strip()}")
        run_command(src.exec_argv([*PEER, "send", dst.ip, port, str(nbytes), str(timeout)]),
                    timeout=timeout)
        out, err = receiver.communicate(timeout=timeout)
        if receiver.returncode != 0:
            raise NetnsError(f"throughput receiver in {dst.netns} failed: {err.strip()}")
        result = json.loads(out)
        return result["bytes"] * 8 / result["seconds"]
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
