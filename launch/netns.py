"""Emulated network hosts: Linux network namespaces on a bridge, shaped with ``tc``.

Topology (one star per cluster)::

    bpsn-<pid>-sched   bpsn-<pid>-s0 ...   bpsn-<pid>-w0 ...      one namespace per host,
          eth0              eth0               eth0                address 10.77.0.x/24
           |                 |                  |                  veth pair per host
        p-sched            p-s0               p-w0
           +------------ br0 (namespace bpsn-<pid>-sw) ----------+  the switch

Every link is shaped in both directions: the host side ``eth0`` shapes what the
host sends, the switch side ``p-<host>`` what it receives (tbf for the rate,
netem for delay and loss). A host therefore has a full-duplex NIC of ``rate``,
and traffic between two hosts crosses two links: its one-way delay is twice
``delay`` (the convention of Mininet and most link emulators).

Nothing is created in the root namespace: deleting the namespaces removes every
link. Names carry the owning process id, so a cluster whose owner died (crash,
SIGKILL) is recognised and removed by :func:`clean_stale`.

Usage::

    from bps.launch.netns import EmulatedCluster, LinkShape

    shape = LinkShape.parse(rate="100mbit", delay="0ms", loss="0%")
    with EmulatedCluster(["w0", "w1"], shape) as cluster:
        host = cluster.hosts["w0"]          # .netns, .ip, .ifname
        subprocess.run(host.exec_argv(["ping", "-c1", cluster.hosts["w1"].ip]))
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

PREFIX = "bpsn-"
SUBNET_PREFIX = "10.77.0."  # a private /24 that exists only inside our namespaces
SUBNET_BITS = 24
FIRST_HOST_OCTET = 2
MAX_HOSTS = 250
HOST_IFNAME = "eth0"
BRIDGE = "br0"
_MTU_FRAME = 1514
HOST_QUEUE_FRAMES = 1000  # Linux's default txqueuelen
HOST_QUEUE_SECONDS = 1.0  # ... but never more than this much traffic
_COMMAND_TIMEOUT = 30.0


class NetnsError(RuntimeError):
    """The emulated network cannot be built or used (privileges, tools, kernel, bad spec)."""


# --------------------------------------------------------------------------- link shape

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30}
_DELAY_UNITS = {"us": 1, "ms": 1000, "s": 1_000_000}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def parse_rate(text: str) -> int | None:
    """``"100mbit"`` -> 100_000_000 bit/s; ``"none"`` -> None (no rate limit).

    Units are tc's bit units (``bit kbit mbit gbit``, and ``kibit mibit gibit``).
    tc's byte units (``kbps``, ``mbps``: bytes per second) are refused because they
    are so often meant as bits.
    """
    value = text.strip().lower()
    if value in ("none", "off", "unlimited"):
        return None
    match = re.fullmatch(_NUMBER + r"\s*([a-z]+)", value)
    if match is None or match.group(2) not in _RATE_UNITS:
        hint = ""
        if match is not None and match.group(2).endswith("bps"):
            hint = (" (tc's 'bps' units mean bytes per second; write bits, "
                    "e.g. 100mbit for 100 megabits per second)")
        raise NetnsError(
            f"--rate: invalid value {text!r}{hint}; expected a number with a unit out of "
            f"{', '.join(_RATE_UNITS)} (e.g. 100mbit, 20mbit, 1gbit) or 'none'")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits < 8000:
        raise NetnsError(f"--rate: {text!r} is below the supported minimum of 8kbit")
    return int(bits)


def parse_delay(text: str) -> int:
    """``"1ms"`` -> 1000 microseconds; ``"0"`` -> 0. Units: ``us``, ``ms``, ``s``."""
    value = text.strip().lower()
    if re.fullmatch(r"0+(\.0*)?", value):
        return 0
    match = re.fullmatch(_NUMBER + r"\s*([a-z]+)", value)
    if match is None or match.group(2) not in _DELAY_UNITS:
        raise NetnsError(f"--delay: invalid value {text!r}; expected a number with a unit "
                         "out of us, ms, s (e.g. 1ms, 500us) or 0")
    micros = float(match.group(1)) * _DELAY_UNITS[match.group(2)]
    if micros > 10_000_000:
        raise NetnsError(f"--delay: {text!r} is more than the supported maximum of 10s")
    return int(round(micros))


def parse_loss(text: str) -> float:
    """``"0.5%"`` -> 0.5 (percent of packets dropped per link direction); ``"0"`` -> 0."""
    value = text.strip()
    match = re.fullmatch(_NUMBER + r"\s*(%?)", value)
    if match is None:
        raise NetnsError(f"--loss: invalid value {text!r}; expected a percentage in [0, 100) "
                         "such as 0%, 0.1% or 1%")
    percent = float(match.group(1))
    if not percent < 100.0:
        raise NetnsError(f"--loss: {text!r} must be below 100%")
    return percent


def format_rate(bits_per_second: int | None) -> str:
    """100_000_000 -> ``"100mbit"``; None -> ``"none"``."""
    if bits_per_second is None:
        return "none"
    for unit, factor in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second % factor == 0:
            return f"{bits_per_second // factor}{unit}"
    return f"{bits_per_second}bit"


@dataclass(frozen=True)
class LinkShape:
    """How every link direction is shaped: rate in bit/s (None: unlimited), delay, loss."""

    rate_bits: int | None
    delay_us: int = 0
    loss_percent: float = 0.0

    @classmethod
    def parse(cls, rate: str, delay: str = "0ms", loss: str = "0%") -> LinkShape:
        return cls(parse_rate(rate), parse_delay(delay), parse_loss(loss))

    @property
    def needs_netem(self) -> bool:
        return self.delay_us > 0 or self.loss_percent > 0

    def tbf_args(self, host_side: bool = False) -> list[str]:
        """tbf parameters sized so the long-term rate is exact at any rate.

        burst: about 2 ms of traffic but at least a few frames (GSO super-packets
        larger than the bucket are segmented by tbf, not dropped). limit, on the
        switch side: about 50 ms of queue, so a few TCP flows meeting on one link
        (incast) keep the link busy instead of losing packets to a tiny buffer. On
        the host side (``host_side``, what the host sends) at least a NIC's transmit
        queue of HOST_QUEUE_FRAMES: a host queues what its own sockets send rather than
        drop it. 50 ms alone is 125 KB at 20 Mbit/s, less than one topk step's pushes
        of the slow-network job, and those local drops cost retransmission timeouts
        (a median step of 395 ms instead of 192 ms). That queue holds at most 1 s of
        traffic (HOST_QUEUE_SECONDS), so at very low rates a full queue cannot hold a
        heartbeat back for longer than the failure detector waits.
        """
        assert self.rate_bits is not None
        rate_bytes = self.rate_bits / 8
        burst = max(4 * _MTU_FRAME, int(rate_bytes * 0.002))
        queue = max(32 * _MTU_FRAME, int(rate_bytes * 0.05))
        if host_side:
            nic_queue = min(HOST_QUEUE_FRAMES * _MTU_FRAME, int(rate_bytes * HOST_QUEUE_SECONDS))
            queue = max(queue, nic_queue)
        limit = burst + queue
        return ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst),
                "limit", str(limit)]

    def netem_args(self) -> list[str]:
        args = ["netem", "limit", "100000"]
        if self.delay_us:
            args += ["delay", f"{self.delay_us}us"]
        if self.loss_percent:
            args += ["loss", f"{self.loss_percent}%"]
        return args

    def describe(self) -> str:
        parts = [f"rate {format_rate(self.rate_bits)}"]
        if self.delay_us:
            parts.append(f"delay {self.delay_us / 1000:g}ms")
        if self.loss_percent:
            parts.append(f"loss {self.loss_percent:g}%")
        return ", ".join(parts) + " per link direction"


# --------------------------------------------------------------------------- commands

def _run(argv: list[str], check: bool = True,
         timeout: float = _COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                         f"{done.stderr.strip() or done.stdout.strip()}")
    return done


def _ip(netns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *(["-n", netns] if netns else []), *args], check=check)


def _tc(netns: str, *args: str) -> subprocess.CompletedProcess:
    return _run(["tc", "-n", netns, *args])


def require_privileges() -> None:
    """Raise :class:`NetnsError` unless we are root and ``ip`` and ``tc`` are installed."""
    if os.geteuid() != 0:
        raise NetnsError("bpslaunch netem needs root: it creates network namespaces, veth links "
                         "and tc qdiscs (run it as root, e.g. with sudo)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"bpslaunch netem needs the iproute2 tools; not found on PATH: "
                         f"{', '.join(missing)} (install the iproute2 package)")


def list_namespaces() -> list[str]:
    """Names of all network namespaces known to ``ip netns``."""
    done = _ip(None, "netns", "list")
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def namespace_pids(netns: str) -> list[int]:
    done = _ip(None, "netns", "pids", netns, check=False)
    return [int(token) for token in done.stdout.split() if token.isdigit()]


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _owner_pid(netns: str) -> int | None:
    match = re.fullmatch(re.escape(PREFIX) + r"(\d+)-.+", netns)
    return int(match.group(1)) if match else None


def kill_namespace_processes(namespaces: list[str], grace: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process living in ``namespaces``; returns their pids."""
    killed: list[int] = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = [pid for ns in namespaces for pid in namespace_pids(ns) if pid != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
            if pid not in killed:
                killed.append(pid)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)
    still = [pid for ns in namespaces for pid in namespace_pids(ns)]
    if still:
        raise NetnsError(f"processes {still} in namespaces {namespaces} survived SIGKILL")
    return killed


def delete_namespaces(namespaces: list[str]) -> None:
    """Kill what runs inside, then delete the namespaces (their veth links go with them)."""
    kill_namespace_processes(namespaces)
    errors = []
    for ns in namespaces:
        done = _ip(None, "netns", "delete", ns, check=False)
        if done.returncode != 0 and ns in list_namespaces():
            errors.append(f"{ns}: {done.stderr.strip()}")
    if errors:
        raise NetnsError("could not delete namespaces: " + "; ".join(errors))


def clean_stale(log=None) -> list[str]:
    """Delete ``bpsn-`` namespaces whose owning process is gone; returns their names."""
    def orphaned(netns: str) -> bool:
        owner = _owner_pid(netns)
        return owner is None or not _pid_alive(owner)

    stale = [ns for ns in list_namespaces() if ns.startswith(PREFIX) and orphaned(ns)]
    if stale:
        if log:
            log(f"removing {len(stale)} namespaces left by a dead run: {' '.join(stale)}")
        delete_namespaces(stale)
    return stale


_netem_probe_result: str | None = None


def netem_missing_reason() -> str | None:
    """None if this kernel has the netem qdisc, else why not (probed once, in a scratch netns)."""
    global _netem_probe_result
    if _netem_probe_result is None:
        probe = f"{PREFIX}{os.getpid()}-probe"
        _ip(None, "netns", "add", probe)
        try:
            done = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem",
                         "delay", "1ms"], check=False)
            _netem_probe_result = "" if done.returncode == 0 else (
                "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so --delay and --loss "
                f"cannot be emulated here; tc said: {done.stderr.strip()}")
        finally:
            delete_namespaces([probe])
    return _netem_probe_result or None


def support_problem() -> str | None:
    """None if namespaces, veth, bridge and tbf all work here; else a reason (for test skips)."""
    try:
        require_privileges()
        clean_stale()
        with EmulatedCluster(["probe"], LinkShape(rate_bits=10**6)):
            pass
    except (NetnsError, OSError) as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------- the cluster

@dataclass(frozen=True)
class Host:
    """One emulated machine: a namespace with one interface on the switch."""

    name: str
    netns: str
    ip: str
    ifname: str = HOST_IFNAME

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class EmulatedCluster:
    """Namespaces for ``host_names`` on one shaped bridge; a context manager.

    ``__enter__`` builds everything (and removes what it built if a step fails);
    ``close()`` / ``__exit__`` kills every process still inside and deletes it all.
    """

    def __init__(self, host_names: list[str], shape: LinkShape, log=None) -> None:
        if not host_names:
            raise NetnsError("an emulated cluster needs at least one host")
        if len(host_names) > MAX_HOSTS:
            raise NetnsError(f"at most {MAX_HOSTS} hosts fit in {SUBNET_PREFIX}0/{SUBNET_BITS}, "
                             f"asked for {len(host_names)}")
        bad = [name for name in host_names if not re.fullmatch(r"[a-z][a-z0-9]{0,12}", name)]
        if bad or len(set(host_names)) != len(host_names) or "sw" in host_names:
            raise NetnsError(f"host names must be distinct, short, lowercase and not 'sw': {bad}")
        self.shape = shape
        self._log = log or (lambda message: None)
        tag = f"{PREFIX}{os.getpid()}-"
        self.switch_netns = tag + "sw"
        self.hosts: dict[str, Host] = {
            name: Host(name, tag + name, f"{SUBNET_PREFIX}{FIRST_HOST_OCTET + i}")
            for i, name in enumerate(host_names)}
        self._created: list[str] = []

    @property
    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts.values()] + [self.switch_netns]

    def __enter__(self) -> EmulatedCluster:
        self.build()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def build(self) -> None:
        require_privileges()
        if self.shape.needs_netem:
            reason = netem_missing_reason()
            if reason:
                raise NetnsError(reason)
        existing = set(list_namespaces())
        clash = [ns for ns in self.namespaces if ns in existing]
        if clash:
            raise NetnsError(f"namespaces already exist: {clash} "
                             "(another cluster of this process?)")
        try:
            self._add_namespace(self.switch_netns)
            _ip(self.switch_netns, "link", "add", "name", BRIDGE, "type", "bridge")
            _ip(self.switch_netns, "link", "set", BRIDGE, "up")
            for host in self.hosts.values():
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        self._log(f"emulated network: {len(self.hosts)} hosts on {SUBNET_PREFIX}0/{SUBNET_BITS}, "
                  f"{self.shape.describe()}")

    def _add_namespace(self, netns: str) -> None:
        _ip(None, "netns", "add", netns)
        self._created.append(netns)
        _ip(netns, "link", "set", "lo", "up")

    def _add_host(self, host: Host) -> None:
        port = f"p-{host.name}"
        self._add_namespace(host.netns)
        _ip(self.switch_netns, "link", "add", "name", port, "type", "veth",
            "peer", "name", host.ifname, "netns", host.netns)
        _ip(self.switch_netns, "link", "set", port, "master", BRIDGE)
        _ip(self.switch_netns, "link", "set", port, "up")
        _ip(host.netns, "addr", "add", f"{host.ip}/{SUBNET_BITS}", "dev", host.ifname)
        _ip(host.netns, "link", "set", host.ifname, "up")
        self._shape(host.netns, host.ifname, host_side=True)
        self._shape(self.switch_netns, port, host_side=False)

    def _shape(self, netns: str, dev: str, host_side: bool) -> None:
        shape = self.shape
        if shape.needs_netem and shape.rate_bits is not None:
            _tc(netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *shape.netem_args())
            _tc(netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                *shape.tbf_args(host_side))
        elif shape.needs_netem:
            _tc(netns, "qdisc", "add", "dev", dev, "root", *shape.netem_args())
        elif shape.rate_bits is not None:
            _tc(netns, "qdisc", "add", "dev", dev, "root", *shape.tbf_args(host_side))

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each host's interface sent and received so far."""
        result = {}
        for name, host in self.hosts.items():
            done = _ip(host.netns, "-j", "-s", "link", "show", "dev", host.ifname)
            stats = json.loads(done.stdout)[0]["stats64"]
            result[name] = {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                            "tx_packets": stats["tx"]["packets"],
                            "rx_packets": stats["rx"]["packets"]}
        return result

    def close(self) -> None:
        """Kill everything inside and delete every namespace this cluster created."""
        if not self._created:
            return
        # Ctrl-C during teardown must not leave half a cluster behind.
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            hosts_first = [ns for ns in reversed(self._created)]
            delete_namespaces(hosts_first)
            self._created = []
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


_RECEIVER = r"""
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
srv.settimeout(float(sys.argv[2]))
conn, _ = srv.accept()
conn.settimeout(float(sys.argv[2]))
total, first, last = 0, None, None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    now = time.perf_counter()
    if first is None:
        first, first_len = now, len(chunk)
    total, last = total + len(chunk), now
print(json.dumps({"bytes": total - first_len, "seconds": last - first}), flush=True)
"""

_SENDER = r"""
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
block = bytes(1 << 16)
left = int(sys.argv[3])
while left > 0:
    conn.sendall(block[:min(left, len(block))])
    left -= len(block)
conn.close()
"""


def measure_throughput(src: Host, dst: Host, nbytes: int, timeout: float = 60.0) -> float:
    """Send ``nbytes`` over one TCP connection from ``src`` to ``dst``; returns bit/s.

    The rate is measured at the receiver, from the first to the last chunk it reads.
    """
    receiver = subprocess.Popen(dst.exec_argv([sys.executable, "-c", _RECEIVER, dst.ip,
                                               str(timeout)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()  # printed once it listens
        if not port.isdigit():
            raise NetnsError(f"throughput receiver in {dst.netns} did not start: "
                             f"{receiver.stderr.read().strip()}")
        _run(src.exec_argv([sys.executable, "-c", _SENDER, dst.ip, port, str(nbytes),
                            str(timeout)]), timeout=timeout)
        out, err = receiver.communicate(timeout=timeout)
        if receiver.returncode != 0:
            raise NetnsError(f"throughput receiver in {dst.netns} failed: {err.strip()}")
        result = json.loads(out)
        return result["bytes"] * 8 / result["seconds"]
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


if __name__ == "__main__":  # pragma: no cover - manual probe
    problem = support_problem()
    print(problem or "network namespaces, veth, bridge and tbf work here")
    sys.exit(1 if problem else 0)
