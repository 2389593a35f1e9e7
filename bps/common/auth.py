"""Cluster credentials and ZeroMQ CURVE: every connection between the scheduler, the
servers and the workers is authenticated and encrypted with the cluster's key.

One keypair per cluster, in a key file that every process reads from
``BPS_SECRET_FILE`` (``bpslaunch keygen PATH`` writes one, mode 0600). Every ROUTER
(scheduler, servers) is a CURVE server with the cluster's secret key and a ZAP
authenticator that admits only clients proving they hold that same key; every DEALER
is a CURVE client with the cluster keypair that checks the server's key. A peer
without the file cannot complete the handshake: none of its messages reaches bps and
it gets no reply. libzmq's CURVE (libsodium) does all the cryptography.

Usage::

    bpslaunch keygen ~/.bps/cluster.key            # once; copy it to every host
    export BPS_SECRET_FILE=~/.bps/cluster.key

    from bps.common import auth
    key = auth.load_key(env)        # None with BPS_INSECURE=1 (loud warning)
    guard = auth.Guard(ctx, key)    # where the process binds a ROUTER
    guard.serve(router)             # before bind
    auth.connect_as_client(dealer, key)   # before connect
    guard.close()                   # before ctx.term()

A refused handshake is reported on both sides within seconds, not as a timeout:
:class:`HandshakeWatch` fails a client whose key a peer refuses, naming its key file
and the peer; :class:`Guard` logs (rate-limited) the address of every peer whose
handshake fails.

``BPS_INSECURE=1`` turns all of this off (plain TCP: anyone who reaches a port can read
and corrupt the job); every role logs a warning when it starts.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth
import zmq.auth.thread
import zmq.utils.z85

from bps.common.env import ClusterEnv, EnvError
from bps.common.protocol import ClusterError, drain
from bps.common.ratelimit import RateLimitedLog

log = logging.getLogger("bps.common.auth")

ZAP_DOMAIN = "bps"
_HEADER = """\
#   bps cluster key. Every scheduler, server and worker of one cluster reads this file
#   (BPS_SECRET_FILE); whoever holds it can join the cluster. Keep it private (mode 0600).
"""

HOW_TO = ("make a key file with `bpslaunch keygen PATH` and start every scheduler, server "
          "and worker with BPS_SECRET_FILE=PATH (`bpslaunch local` and `bpslaunch netem` "
          "make one per job themselves), or set BPS_INSECURE=1 to run without "
          "authentication and encryption")


class AuthError(EnvError):
    """Missing, unreadable or malformed cluster credentials; the message says what to do."""


@dataclass(frozen=True)
class ClusterKey:
    """The cluster's CURVE keypair, Z85-encoded (40 characters each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"ClusterKey(public={self.public.decode()!r})"


def write_key_file(path: str) -> ClusterKey:
    """Write a fresh cluster key to ``path`` (mode 0600); refuses to overwrite anything.

        >>> key = write_key_file("/tmp/cluster.key")      # doctest: +SKIP
    """
    public, secret = zmq.curve_keypair()
    text = (f"{_HEADER}metadata\ncurve\n    public-key = \"{public.decode()}\"\n"
            f"    secret-key = \"{secret.decode()}\"\n")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AuthError(f"{path} already exists: bpslaunch keygen never overwrites a key "
                        "file (remove it first if you mean to replace the cluster's key)"
                        ) from None
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)  # whatever the umask
        handle.write(text)
    return ClusterKey(public, secret)


def read_key_file(path: str) -> ClusterKey:
    """The key in ``path``; raises :class:`AuthError` if it is missing, readable by others
    or malformed."""
    where = f"BPS_SECRET_FILE={path}"
    try:
        info = os.stat(path)
    except OSError as exc:
        raise AuthError(f"{where}: {exc.strerror}; {HOW_TO}") from None
    if not stat.S_ISREG(info.st_mode):
        raise AuthError(f"{where} is not a regular file")
    if info.st_mode & 0o077:
        raise AuthError(f"{where} is accessible by other users (mode "
                        f"{stat.S_IMODE(info.st_mode):04o}): run `chmod 600 {path}`")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AuthError(f"{where}: not a bps key file ({exc}); {HOW_TO}") from None
    if not public or not secret or len(public) != 40 or len(secret) != 40:
        raise AuthError(f"{where}: no public-key and secret-key in it; {HOW_TO}")
    try:
        matches = zmq.curve_public(secret) == public
    except zmq.ZMQError:
        matches = False
    if not matches:
        raise AuthError(f"{where}: its public-key does not belong to its secret-key "
                        "(a damaged file?)")
    return ClusterKey(public, secret)


def load_key(env: ClusterEnv) -> ClusterKey | None:
    """The cluster key of this process; None (after a warning) with ``BPS_INSECURE=1``.
    Raises :class:`AuthError` saying how to make one when neither is set."""
    if env.insecure:
        log.warning("BPS_INSECURE=1: this %s runs WITHOUT authentication or encryption; "
                    "anyone who can reach its ports can join the job, read every gradient "
                    "and corrupt the model", env.role)
        return None
    if env.secret_file is None:
        raise AuthError(f"no cluster credentials: BPS_SECRET_FILE is not set; {HOW_TO}")
    return read_key_file(env.secret_file)


def connect_as_client(sock: Any, key: ClusterKey | None) -> None:
    """Make ``sock`` (before ``connect``) a CURVE client of the cluster (no-op if None)."""
    if key is None:
        return
    sock.curve_serverkey = key.public
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret


REFUSED_KEPT = 8  # kinds of refusal (host, why) a Guard counts for error messages
NOT_A_MEMBER = ("it does not hold the cluster key of BPS_SECRET_FILE, or runs with "
                "BPS_INSECURE=1")


class RefusedPeers:
    """The handshakes a :class:`Guard` refused, counted by host and reason (the first
    ``REFUSED_KEPT`` kinds), for the messages that explain why a peer never arrived.
    Thread-safe: the ZAP and monitor threads add, the owner reads.

        >>> refused = RefusedPeers()
        >>> refused.add("10.0.0.7:41234", "another key")
        >>> refused.add("10.0.0.7:41240", "another key")
        >>> refused.summary()
        ['10.0.0.7 (2 handshakes refused: another key)']
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, peer: str, why: str) -> None:
        host = peer.rpartition(":")[0] if peer.count(":") == 1 else peer  # not the port
        with self._lock:
            if (host, why) in self._counts or len(self._counts) < REFUSED_KEPT:
                self._counts[(host, why)] = self._counts.get((host, why), 0) + 1

    def summary(self) -> list[str]:
        """``"host (N handshakes refused: why)"`` per kind, first seen first (a host not
        known, ``?``, only where no other is)."""
        with self._lock:
            counts = list(self._counts.items())
        known = [item for item in counts if item[0][0] != "?"]
        return [f"{host} ({n} handshake{'s' if n > 1 else ''} refused: {why})"
                for (host, why), n in (known or counts)]


class Guard:
    """The ZAP authenticator of one ZeroMQ context: admits only CURVE clients holding the
    cluster key, logging (rate-limited) the address of every peer it refuses, also of
    those whose handshake fails before ZAP is asked (another cluster's key, plain TCP).
    ``refused`` counts them (:class:`RefusedPeers`), for the messages that explain why
    a peer never arrived (the scheduler's rendezvous timeout).
    """

    def __init__(self, ctx: Any, key: ClusterKey | None) -> None:
        self.key = key
        self.refused = RefusedPeers()
        self._auth = None
        self._failures: _FailedHandshakeLog | None = None
        if key is None:
            return
        refusals = RateLimitedLog(log)
        self._auth = _Authenticator(ctx, key.public, refusals, self.refused)
        self._auth.start()
        self._failures = _FailedHandshakeLog(refusals, self.refused)

    def serve(self, sock: Any, watch_closes: bool = False) -> None:
        """Make ``sock`` (before ``bind``) a CURVE server of the cluster (no-op if None).
        ``watch_closes``: also record the file descriptor of each of its connections that
        closes (:meth:`closed_connections`), with or without a key."""
        if self.key is None:
            if watch_closes:
                if self._failures is None:
                    self._failures = _FailedHandshakeLog(RateLimitedLog(log), self.refused)
                self._failures.record_closes = True
                self._failures.watch(sock)
            return
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_secretkey = self.key.secret
        sock.curve_publickey = self.key.public
        sock.curve_server = True
        self._failures.record_closes = self._failures.record_closes or watch_closes
        self._failures.watch(sock)

    def closed_connections(self) -> list[int]:
        """The file descriptors of the served sockets' connections that closed since the
        last call (a message's ``zmq.SRCFD`` names the connection it came on)."""
        return self._failures.take_closed() if self._failures is not None else []

    def close(self) -> None:
        """Stop the authenticator (before the context is terminated)."""
        if self._failures is not None:
            self._failures.close()
            self._failures = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
           zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused"}
_WATCHED = (zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _peer_of(fd: int) -> str:
    """``host:port`` at the other end of the TCP connection ``fd`` (not taken over), or
    ``?`` where it is already closed."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            host, port = conn.getpeername()[:2]
    except (OSError, ValueError):
        return "?"
    return f"{host}:{port}"


def _events(monitor: Any) -> Iterator[tuple[int, int]]:
    """The (event, value) pairs waiting on a monitor socket, without blocking."""
    for frames in drain(monitor):
        head = frames[0].bytes
        yield int.from_bytes(head[:2], "little"), int.from_bytes(head[2:6], "little")


class _FailedHandshakeLog(threading.Thread):
    """Logs the address of every peer whose CURVE handshake with a served socket fails
    without reaching ZAP (the ZAP handler logs its own refusals). libzmq's monitor names
    the connection by its file descriptor: the peer's address is read when it is accepted,
    and named when that connection closes after a failed handshake."""

    def __init__(self, refusals: RateLimitedLog, refused: RefusedPeers) -> None:
        super().__init__(name="bps-handshake-log", daemon=True)
        self.refusals = refusals
        self.refused = refused
        self._lock = threading.Lock()
        self._monitors: list[tuple[Any, Any]] = []  # (served socket, its monitor)
        self._closed: list[int] = []  # fds of connections that closed, not taken yet
        self.record_closes = False  # whether to keep them (someone takes them)
        self._stopping = threading.Event()
        self.start()

    def watch(self, sock: Any) -> None:
        monitor = sock.get_monitor_socket(_WATCHED)
        monitor.linger = 0
        with self._lock:
            self._monitors.append((sock, monitor))

    def run(self) -> None:
        peers: dict[int, str] = {}  # fd -> address of accepted connections
        failed = 0  # failures not yet matched to a closed connection
        while not self._stopping.is_set():
            with self._lock:
                monitors = [m for _, m in self._monitors]
            poller = zmq.Poller()
            for monitor in monitors:
                poller.register(monitor, zmq.POLLIN)
            for monitor, _ in poller.poll(200):  # 200 ms: how soon close() is noticed
                for event, value in _events(monitor):
                    if event == zmq.EVENT_ACCEPTED:
                        peers[value] = _peer_of(value)
                    elif event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                                   zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                        failed += 1
                    elif event == zmq.EVENT_DISCONNECTED:
                        peer = peers.pop(value, "?")
                        if self.record_closes:
                            with self._lock:
                                self._closed.append(value)
                        if failed:
                            failed -= 1
                            self.refused.add(peer, NOT_A_MEMBER)
                            self.refusals.warning(
                                "refused a connection from %s: its handshake failed (it does "
                                "not hold the cluster key of BPS_SECRET_FILE, or runs with "
                                "BPS_INSECURE=1)", peer)

    def take_closed(self) -> list[int]:
        with self._lock:
            closed, self._closed = self._closed, []
        return closed

    def close(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
        with self._lock:
            for sock, monitor in self._monitors:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass  # the socket is closed already
                monitor.close()
            self._monitors.clear()


REFUSALS = 3  # failed handshakes in a row, with no success, that mean "wrong key"


class HandshakeWatch:
    """A client's side of refused handshakes: :meth:`check` raises a ClusterError naming
    this process's key file and the peer once a peer refused REFUSALS handshakes in a row
    (a server with another key closes the connection at once, and ZeroMQ retries every
    100 ms, so this takes well under a second); sockets stop being watched at their first
    successful handshake. Used from one thread::

        watch = HandshakeWatch(env, "worker")
        watch.add(dealer, "server 0 (tcp://10.0.0.2:4000)")   # before connect
        # in the poll loop: register watch.sockets(); unregister what check(ready) returns
        watch.close()                                          # before closing the sockets
    """

    def __init__(self, env: ClusterEnv, role: str) -> None:
        self.env = env
        self.role = role
        self._watched: dict[Any, tuple[Any, str]] = {}  # monitor -> (socket, peer)
        self._failures: dict[Any, int] = {}

    def add(self, sock: Any, peer: str) -> None:
        monitor = sock.get_monitor_socket(_WATCHED)
        monitor.linger = 0
        self._watched[monitor] = (sock, peer)
        self._failures[monitor] = 0

    def sockets(self) -> list[Any]:
        return list(self._watched)

    def watching(self) -> bool:
        return bool(self._watched)

    def check(self, ready: Any = None) -> list[Any]:
        """Read the events of the monitors in ``ready`` (all if None); returns the
        monitors no longer watched (closed: unregister them). Raises ClusterError where
        a peer refused this process's key."""
        done = []
        for monitor in list(self._watched):
            if ready is not None and monitor not in ready:
                continue
            for event, _ in _events(monitor):
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    done.append(monitor)
                    break
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self._failures[monitor] = REFUSALS
                elif event in _FAILED:
                    self._failures[monitor] += 1
                if self._failures[monitor] >= REFUSALS:
                    raise ClusterError(self._refused(self._watched[monitor][1]))
        for monitor in done:
            self._forget(monitor)
        return done

    def forget(self, sock: Any) -> list[Any]:
        """Stop watching ``sock`` (before closing it); returns its monitors (unregister
        them)."""
        monitors = [m for m, (watched, _) in self._watched.items() if watched is sock]
        for monitor in monitors:
            self._forget(monitor)
        return monitors

    def _refused(self, peer: str) -> str:
        if self.env.insecure:
            why = ("this process runs with BPS_INSECURE=1 (plain TCP) and the peer does not; "
                   "start every role of the job the same way")
        else:
            why = (f"the key in BPS_SECRET_FILE={self.env.secret_file} is not the one the "
                   f"peer was started with (every role of a job needs the same key file), "
                   f"or the peer runs with BPS_INSECURE=1")
        return (f"{peer} refused this {self.role}'s cluster key ({REFUSALS} handshakes "
                f"failed): {why}")

    def _forget(self, monitor: Any) -> None:
        sock, _ = self._watched.pop(monitor)
        del self._failures[monitor]
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close()

    def close(self) -> None:
        for monitor in list(self._watched):
            self._forget(monitor)




class _Authenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's ZAP thread, admitting exactly the cluster's public key."""

    def __init__(self, ctx: Any, public: bytes, refusals: RateLimitedLog,
                 refused: RefusedPeers) -> None:
        super().__init__(ctx, log=logging.getLogger("bps.common.auth.zap"))
        self.public = public
        self.refusals = refusals
        self.refused = refused
        self.address = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        if hmac.compare_digest(zmq.utils.z85.encode(client_key), self.public):
            return True, b"OK"
        self.refused.add(self.address, NOT_A_MEMBER)
        self.refusals.warning("refused a connection from %s: it does not hold the cluster "
                              "key (BPS_SECRET_FILE)", self.address)
        return False, b"not a member of this cluster"


KEY_FOLDER_PREFIX = "bps-key-"


def remove_orphaned_key_folders(parent: str) -> list[str]:
    """Remove the key folders of launchers that died without cleaning up (``kill -9``):
    ``bps-key-<pid>-*`` whose pid is no longer running. Returns the removed paths."""
    removed = []
    for entry in os.scandir(parent):
        if not entry.name.startswith(KEY_FOLDER_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid_text = entry.name[len(KEY_FOLDER_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _running(int(pid_text)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def job_credentials(environ: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """For a launcher that starts a whole job here (``bpslaunch local`` / ``netem``): the
    variables to add to every process's environment, a fresh key in a private temporary
    directory (removed afterwards); nothing with ``BPS_INSECURE=1``.

        with job_credentials(os.environ) as extra:
            env.update(extra)       # {"BPS_SECRET_FILE": "/tmp/bps-key-.../cluster.key"}
    """
    if environ.get("BPS_INSECURE", "").strip() == "1":
        yield {}
        return
    remove_orphaned_key_folders(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=f"{KEY_FOLDER_PREFIX}{os.getpid()}-")  # mode 0700
    try:
        path = os.path.join(folder, "cluster.key")
        write_key_file(path)
        yield {"BPS_SECRET_FILE": path}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
