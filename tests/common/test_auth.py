"""Authentication, encryption and membership with real processes over loopback: the
cluster key file, roles that refuse to start without it, outsiders that get nothing
from any port while the job's results stay bit-identical, and identities that cannot
be taken over (see docs/runtime.md, "Security")."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import zmq

from bps.common.auth import (
    AuthError,
    ClusterKey,
    connect_as_client,
    job_credentials,
    read_key_file,
    remove_orphaned_key_folders,
    write_key_file,
)
from bps.common.protocol import Op, encode, new_token
from bps.launch.role import free_port
from tests.harness.ps_job import BPSLAUNCH, JOB, TEST_ENV, check_raw_aggregates, run_command

EXIT_WITHIN = 120.0


def test_keygen_writes_a_private_key_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    done = subprocess.run(BPSLAUNCH + ["keygen", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = read_key_file(str(path))
    assert len(key.public) == len(key.secret) == 40 and key.secret.decode() not in repr(key)
    before = path.read_bytes()
    again = subprocess.run(BPSLAUNCH + ["keygen", str(path)], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 1 and "already exists" in again.stderr, again.stderr
    assert path.read_bytes() == before
    path.chmod(0o644)
    with pytest.raises(AuthError, match=r"accessible by other users \(mode 0644\): run "
                                        r"`chmod 600"):
        read_key_file(str(path))
    damaged = tmp_path / "damaged.key"
    damaged.write_text(before.decode().replace(key.public.decode(), "0" * 40))
    damaged.chmod(0o600)
    with pytest.raises(AuthError, match="does not belong to its secret-key"):
        read_key_file(str(damaged))


def test_a_killed_launchers_key_folder_is_removed_by_the_next_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = ("import sys\nfrom bps.common.auth import job_credentials\n"
              "with job_credentials({}) as extra:\n"
              "    print(extra['BPS_SECRET_FILE'], flush=True)\n    sys.stdin.read()\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        key_file = Path(proc.stdout.readline().strip())
        assert key_file.is_file() and key_file.parent.parent == tmp_path
    finally:
        proc.kill()  # no cleanup: the folder and its key stay behind
        proc.wait(timeout=30)
    assert key_file.is_file()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with job_credentials({}) as extra:
        live = Path(extra["BPS_SECRET_FILE"])
        assert not key_file.parent.exists()  # the dead launcher's folder is gone
        assert remove_orphaned_key_folders(str(tmp_path)) == []  # a live one stays
        assert live.is_file()
    assert not live.parent.exists()


@pytest.mark.parametrize("role", ["scheduler", "server", "worker"])
def test_a_role_without_credentials_refuses_to_start(role: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("BPS_SECRET_FILE", "BPS_INSECURE")}
    env.update(DMLC_ROLE=role, DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0",
               DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()))
    done = subprocess.run(BPSLAUNCH + [sys.executable, "-c", "pass"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "BPS_SECRET_FILE is not set" in done.stderr
    assert "bpslaunch keygen PATH" in done.stderr and "BPS_INSECURE=1" in done.stderr


def test_insecure_mode_is_announced_by_every_role() -> None:
    script = ("from bps.common.env import ClusterEnv\nfrom bps.worker.engine import WorkerEngine\n"
              "WorkerEngine.connect(ClusterEnv.from_environ()).close()\n")
    env = {**TEST_ENV, "BPS_INSECURE": "1", "BPS_SECRET_FILE": ""}
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1", "--",
                                            sys.executable, "-c", script], env, timeout=120)
    assert code == 0, output
    for name in ("scheduler", "server0", "worker0.0", "worker1.0"):
        assert re.search(rf"\[{name}\] .*BPS_INSECURE=1: this \w+ runs WITHOUT authentication",
                         output), (name, output)


# ---------------------------------------------------------------------- outsiders

class Outsider:
    """DEALER sockets to one address, one per kind of outsider: plain TCP, a client that
    knows the cluster's public key but not its secret, one with another cluster's key."""

    def __init__(self, ctx: zmq.Context, address: str, cluster: ClusterKey) -> None:
        stranger = ClusterKey(*zmq.curve_keypair())
        self.socks = {"plain": ctx.socket(zmq.DEALER), "public_key_only": ctx.socket(zmq.DEALER),
                      "other_cluster": ctx.socket(zmq.DEALER)}
        own_public, own_secret = zmq.curve_keypair()
        self.socks["public_key_only"].curve_serverkey = cluster.public
        self.socks["public_key_only"].curve_publickey = own_public
        self.socks["public_key_only"].curve_secretkey = own_secret
        connect_as_client(self.socks["other_cluster"], stranger)
        for sock in self.socks.values():
            sock.linger = 0
            sock.connect(address)

    def send(self, frames: list[bytes]) -> None:
        for sock in self.socks.values():
            # between its refused handshakes ZeroMQ may have no connection to queue on
            sock.sndtimeo = 1000
            try:
                sock.send_multipart(frames)
            except zmq.Again:
                pass

    def received(self) -> dict[str, int]:
        """Messages each socket got (none is the whole point)."""
        counts = {}
        for name, sock in self.socks.items():
            counts[name] = 0
            while sock.poll(0):
                sock.recv_multipart()
                counts[name] += 1
        return counts


def test_outsiders_get_nothing_and_the_job_is_unchanged(cluster, tmp_path: Path) -> None:
    """Without the cluster key nobody gets an answer from the scheduler or a server: not
    to HELLO as worker 1 before the real one (a hijack at startup), REGISTER, PUSH, PULL,
    GET_STATE, SET_STATE, BARRIER, FINALIZE or FAILED; the job's aggregates are exactly
    the numpy sums. A member's second HELLO for worker 1 is refused and logged."""
    p = cluster(workers=2, servers=1, timeout=60.0,
                heartbeat_timeout=float(TEST_ENV["BPS_HEARTBEAT_TIMEOUT"]))
    key = read_key_file(os.environ["BPS_SECRET_FILE"])
    ctx = zmq.Context()
    insider = ctx.socket(zmq.DEALER)
    insider.linger = 0
    try:
        p.start("scheduler", BPSLAUNCH, DMLC_ROLE="scheduler")
        p.wait_for_line("scheduler", "scheduler listening on")
        at_scheduler = Outsider(ctx, f"tcp://127.0.0.1:{p.port}", key)
        token = new_token()
        at_scheduler.send([encode(Op.HELLO, role="worker", worker_id=1, addr="127.0.0.1",
                                  token=token)])
        at_scheduler.send([encode(Op.HELLO, role="server", worker_id=0, addr="tcp://1.2.3.4:5",
                                  token=b"")])
        p.start("server0", BPSLAUNCH, DMLC_ROLE="server", BPS_SERVER_ID="0")
        address = p.wait_for_line("server0", r"server listening on (tcp://\S+)").group(1)
        at_server = Outsider(ctx, address, key)
        push = {"rid": 1, "key": 0, "step": 0, "node": 1, "dtype": "float32", "numel": 16384,
                "nbytes": 65536, "lr": 0.1}
        for frames in ([encode(Op.REGISTER, rid=1, key=0, numel=16384, dtype="float32",
                               name="t0", params=None, node=1)],
                       [encode(Op.PUSH, **push), b"\0" * 65536],
                       [encode(Op.PULL, rid=2, key=0, step=0)],
                       [encode(Op.GET_STATE, rid=3, key=200)],
                       [encode(Op.SET_STATE, rid=4, key=200, nbytes=1), b"\0"]):
            at_server.send(frames)
        p.start("worker0", [sys.executable, JOB, "--out", str(tmp_path), "--case", "raw"],
                DMLC_ROLE="worker", DMLC_WORKER_ID="0")
        p.start("worker1", [sys.executable, JOB, "--out", str(tmp_path), "--case", "raw"],
                DMLC_ROLE="worker", DMLC_WORKER_ID="1")
        p.wait_for_line("scheduler", r"registered worker 1 at 127\.0\.0\.1")
        # a member of the cluster who says HELLO as worker 1 after it arrived is refused
        connect_as_client(insider, key)
        insider.connect(f"tcp://127.0.0.1:{p.port}")
        insider.send(encode(Op.HELLO, role="worker", worker_id=1, addr="127.0.0.1",
                            token=new_token()))
        assert insider.poll(20_000), "no answer to the second HELLO as worker 1"
        from bps.common.protocol import decode

        refusal = decode(insider.recv())
        assert refusal["op"] == Op.ERROR, refusal
        assert ("registered twice" in refusal["msg"]
                or "rendezvous already complete" in refusal["msg"]), refusal
        for frames in ([encode(Op.BARRIER, seq=0, step=0)], [encode(Op.FINALIZE, step=0)],
                       [encode(Op.FAILED, msg="outsider")], [encode(Op.HEARTBEAT)],
                       [encode(Op.SHUTDOWN)]):
            at_scheduler.send(frames)
        at_server.send([encode(Op.PULL, rid=5, key=0, step=1)])
        at_server.send([encode(Op.SHUTDOWN)])
        codes = p.wait_all(EXIT_WITHIN)
        assert codes == dict.fromkeys(codes, 0), {n: p.log(n)[-3000:] for n in codes}
        assert at_scheduler.received() == dict.fromkeys(at_scheduler.socks, 0)
        assert at_server.received() == dict.fromkeys(at_server.socks, 0)
    finally:
        ctx.destroy(linger=0)
    runs = [torch.load(tmp_path / f"node{n}.pt", weights_only=False) for n in range(2)]
    check_raw_aggregates(runs)
    scheduler_log = p.log("scheduler")
    assert "refused a connection from 127.0.0.1: it does not hold the cluster key" in \
        scheduler_log + p.log("server0")
    assert re.search(r"refused a message from 127\.0\.0\.1: HELLO as worker 1: "
                     r"(DMLC_WORKER_ID=1 registered twice|rendezvous already complete)",
                     scheduler_log), scheduler_log


def test_fuzzed_frames_from_a_key_holder_change_nothing(tmp_path: Path) -> None:
    """10,000 fuzzed messages from a connection that holds the cluster key (to the server
    and the scheduler, replies never read), floods of GET_STATE and PULL from a worker's
    own connection and a frame over BPS_MAX_MESSAGE_BYTES, all during a real job: every
    process exits 0, the aggregates are exactly the numpy sums, and the server's peak
    memory stays under the stated bound."""
    code, output = run_command(
        BPSLAUNCH + ["local", "--workers", "2", "--servers", "1", "--", sys.executable, JOB,
                     "--out", str(tmp_path), "--case", "raw", "--fuzz", "10000"],
        TEST_ENV, timeout=300)
    assert code == 0, output[-5000:]
    runs = [torch.load(tmp_path / f"node{n}.pt", weights_only=False) for n in range(2)]
    assert runs[0]["fuzzed"] == {"sent": 10000}
    check_raw_aggregates(runs)
    peak = re.search(r"\[server0\] .*peak resident memory (\d+) MB", output)
    assert peak is not None, output[-3000:]
    assert int(peak.group(1)) < 700, peak.group(0)  # docs/runtime.md: the server's bound
    assert "similar lines suppressed" in output  # the refusals' log is rate-limited


def test_a_node_with_another_key_is_told_to_check_its_key_file(cluster, tmp_path: Path
                                                               ) -> None:
    """A server whose BPS_SECRET_FILE holds another cluster's key never gets through the
    handshake; its rendezvous fails once its handshakes have failed (long before
    BPS_TIMEOUT), naming its key file and what to check."""
    from bps.common.auth import write_key_file

    other = tmp_path / "other.key"
    write_key_file(str(other))
    p = cluster(workers=1, servers=1, timeout=30.0, heartbeat_timeout=2.0)
    p.start("scheduler", BPSLAUNCH, DMLC_ROLE="scheduler")
    p.start("server0", BPSLAUNCH, DMLC_ROLE="server", BPS_SECRET_FILE=str(other))
    code = p.procs["server0"].wait(timeout=EXIT_WITHIN)
    assert code != 0
    log = p.log("server0")
    assert "refused this server's cluster key" in log, log
    assert f"BPS_SECRET_FILE={other}" in log, log
    assert "registered server" not in p.log("scheduler")


def test_a_worker_with_another_key_fails_in_seconds_naming_its_key_file(
        cluster, tmp_path: Path) -> None:
    """Scheduler and server hold one key, a worker another (each from `bpslaunch keygen`):
    the scheduler logs the refusal with the worker's address, and the worker fails
    within 10 s of that (its start-up alone may take longer on a loaded host), long
    before BPS_TIMEOUT, saying the scheduler refused its key and naming its key file."""
    keys = {}
    for name in ("cluster", "other"):
        keys[name] = str(tmp_path / f"{name}.key")
        done = subprocess.run(BPSLAUNCH + ["keygen", keys[name]], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    p = cluster(workers=1, servers=1, timeout=60.0)
    p.start("scheduler", BPSLAUNCH, DMLC_ROLE="scheduler", BPS_SECRET_FILE=keys["cluster"])
    p.start("server0", BPSLAUNCH, DMLC_ROLE="server", BPS_SECRET_FILE=keys["cluster"])
    p.wait_for_line("scheduler", "scheduler listening on")
    p.start("worker0", [sys.executable, JOB, "--out", str(tmp_path), "--case", "loop"],
            DMLC_ROLE="worker", DMLC_WORKER_ID="0", BPS_SECRET_FILE=keys["other"])
    logged = r"refused a connection from 127\.0\.0\.1:\d+: its handshake failed \(it does " \
        r"not hold the cluster key"
    p.wait_for_line("scheduler", logged, timeout=EXIT_WITHIN)
    first_refusal = p.outputs["scheduler"].first("refused a connection from 127.0.0.1:")
    code = p.procs["worker0"].wait(timeout=EXIT_WITHIN)
    refused = p.outputs["worker0"].first("refused this worker's cluster key")
    assert code != 0 and refused is not None, p.log("worker0")
    assert refused - first_refusal < 10.0, (p.log("scheduler"), p.log("worker0"))
    assert (f"the scheduler at tcp://127.0.0.1:{p.port} refused this worker's cluster key"
            in p.log("worker0")), p.log("worker0")
    assert f"BPS_SECRET_FILE={keys['other']}" in p.log("worker0"), p.log("worker0")


def test_the_others_timeout_names_the_address_whose_key_was_refused(
        cluster, tmp_path: Path) -> None:
    """Worker 1 holds another cluster's key: it fails naming its key file, and the
    rendezvous timeout of everyone else says which address the scheduler refused and
    why, not only ``workers missing: [1]``."""
    keys = {}
    for name in ("cluster", "other"):
        keys[name] = str(tmp_path / f"{name}.key")
        write_key_file(keys[name])
    # the scheduler waits BPS_TIMEOUT from its start, then every role ends: worker 1
    # must reach it before then, its imports slowed by three other processes starting
    p = cluster(workers=2, servers=1, timeout=10.0)
    p.start("scheduler", BPSLAUNCH, DMLC_ROLE="scheduler", BPS_SECRET_FILE=keys["cluster"])
    p.start("server0", BPSLAUNCH, DMLC_ROLE="server", BPS_SECRET_FILE=keys["cluster"])
    for node, key in enumerate((keys["cluster"], keys["other"])):
        p.start(f"worker{node}", [sys.executable, JOB, "--out", str(tmp_path), "--case",
                                  "loop"],
                DMLC_ROLE="worker", DMLC_WORKER_ID=str(node), BPS_SECRET_FILE=key)
    code = p.procs["worker1"].wait(timeout=EXIT_WITHIN)
    assert code != 0 and f"BPS_SECRET_FILE={keys['other']}" in p.log("worker1"), \
        p.log("worker1")
    for name in ("scheduler", "server0", "worker0"):
        code = p.procs[name].wait(timeout=EXIT_WITHIN)
        out = p.log(name)
        assert code != 0, (name, out)
        assert re.search(r"rendezvous timed out .*workers missing: \[1\]; .*refused: "
                         r"127\.0\.0\.1 \(\d+ handshakes? refused: it does not hold the "
                         r"cluster key of BPS_SECRET_FILE", out), (name, out)
