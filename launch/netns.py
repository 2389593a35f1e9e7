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

Usage (link shapes: :mod:`bps.launch.link_shape`; measuring a link:
:mod:`bps.launch.throughput`)::

    from bps.launch.link_shape import LinkShape
    from bps.launch.netns import EmulatedCluster

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

from bps.launch.link_shape import LinkShape, NetnsError

PREFIX = "bpsn-"
SUBNET_PREFIX = "10.77.0."  # a private /24 that exists only inside our namespaces
SUBNET_BITS = 24
FIRST_HOST_OCTET = 2
MAX_HOSTS = 250
HOST_IFNAME = "eth0"
BRIDGE = "br0"
_COMMAND_TIMEOUT = 30.0


# --------------------------------------------------------------------------- commands

def run_command(argv: list[str], check: bool = True,
         timeout: float = _COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``argv``; a timeout, or a failure where ``check``, raises :class:`NetnsError`."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                         f"{done.stderr.strip() or done.stdout.strip()}")
    return done


def _ip(netns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_command(["ip", *(["-n", netns] if netns else []), *args], check=check)


def _tc(netns: str, *args: str) -> subprocess.CompletedProcess:
    return run_command(["tc", "-n", netns, *args])


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
            done = run_command(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem",
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


if __name__ == "__main__":  # pragma: no cover - manual probe
    problem = support_problem()
    print(problem or "network namespaces, veth, bridge and tbf work here")
    sys.exit(1 if problem else 0)
