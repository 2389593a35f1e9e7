"""bpslaunch netem: emulated hosts in network namespaces, shaped with tc.

The tests that build namespaces are marked ``netns`` and skip, with the reason,
where the machine does not allow them (not root, no ip/tc, no veth/bridge/tbf).
Each checks afterwards that nothing is left behind: no namespace of the run, no
new link in the root namespace, no process carrying the run's marker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from bps.launch.link_shape import LinkShape, NetnsError, parse_delay, parse_loss, parse_rate
from bps.launch.netns import PREFIX, EmulatedCluster, clean_stale, list_namespaces, support_problem
from tests.harness.cluster_job import ok_fields
from tests.harness.netem_runs import netem_runs
from tests.harness.paths import BENCH, DATA, HARNESS
from tests.harness.paths import ROOT as REPO
from tests.harness.ps_job import BPSLAUNCH, default_sigint

# DATA: small saved slow-network tables (tests/data/README.md)
NETEM = [*BPSLAUNCH, "netem"]
TIMEOUT = 120
MARKER_VAR = "BPS_NETEM_TEST_MARKER"  # every process of a test run inherits it


# --------------------------------------------------------------------------- no root needed

@pytest.mark.parametrize("text, bits", [
    ("100mbit", 100_000_000), ("20Mbit", 20_000_000), ("1gbit", 10**9), ("512kbit", 512_000),
    ("1.5mbit", 1_500_000), ("8bit", None), ("none", None)])
def test_parse_rate(text, bits):
    if text == "8bit":
        with pytest.raises(NetnsError, match="minimum"):
            parse_rate(text)
    else:
        assert parse_rate(text) == bits


@pytest.mark.parametrize("text, needle", [
    ("100mbps", "bytes per second"), ("100", "invalid"), ("fast", "invalid"),
    ("-5mbit", "invalid"), ("10 furlongs", "invalid")])
def test_parse_rate_rejects(text, needle):
    with pytest.raises(NetnsError, match=needle) as info:
        parse_rate(text)
    assert "--rate" in str(info.value) and repr(text) in str(info.value)


def test_parse_delay_and_loss():
    assert parse_delay("1ms") == 1000
    assert parse_delay("250us") == 250
    assert parse_delay("0.5s") == 500_000
    assert parse_delay("0") == 0
    assert parse_loss("0%") == 0.0
    assert parse_loss("0.25%") == 0.25
    for bad in ("1", "ms", "-1ms", "1h"):
        with pytest.raises(NetnsError, match="--delay"):
            parse_delay(bad)
    for bad in ("100%", "abc", "-1%", "5%%"):
        with pytest.raises(NetnsError, match="--loss"):
            parse_loss(bad)


def _tbf_values(rate: int, host_side: bool) -> tuple[int, int]:
    args = LinkShape(rate_bits=rate).tbf_args(host_side)
    values = dict(zip(args[1::2], args[2::2], strict=True))
    assert args[0] == "tbf" and values["rate"] == f"{rate}bit"
    return int(values["burst"]), int(values["limit"])


@pytest.mark.parametrize("rate", [10**6, 20 * 10**6, 100 * 10**6, 10**9])
def test_tbf_parameters_scale_with_rate(rate):
    """The bucket holds at least a few frames; the switch side queues about 50 ms of
    traffic, the host side at least a NIC's 1000-frame transmit queue, but at most 1 s
    of traffic, as well."""
    burst, limit = _tbf_values(rate, host_side=False)
    assert burst >= 4 * 1514 and burst >= rate / 8 * 0.002 - 1
    assert limit - burst >= rate / 8 * 0.05 - 1 and limit - burst >= 32 * 1514
    assert limit - burst <= max(rate / 8 * 0.05 + 1, 32 * 1514)
    host_burst, host_limit = _tbf_values(rate, host_side=True)
    assert host_burst == burst
    assert host_limit - burst == max(limit - burst, min(1000 * 1514, rate // 8))


def _cli(args: list[str], marker: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    env = kwargs.pop("env", dict(os.environ))
    if marker:
        env[MARKER_VAR] = marker
    return subprocess.run(NETEM + args, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=REPO, env=env, **kwargs)


def assert_built_nothing(before: set[str] | None) -> None:
    """No namespace appeared since ``before`` (others' may have gone: every run removes
    the namespaces of owners that died)."""
    after = namespaces_if_visible()
    assert before is None or after - before == set(), after - before


def namespaces_if_visible() -> set[str] | None:
    """The network namespaces where root with ``ip`` can list them (to check that a run
    built none); None elsewhere."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    return set(list_namespaces())


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "2", "--rate", "100mbps", "--", "true"], "bytes per second"),
    (["--nodes", "2", "--rate", "100mbit", "--delay", "fast", "--", "true"], "--delay"),
    (["--nodes", "2", "--rate", "100mbit", "--loss", "200%", "--", "true"], "--loss"),
    (["--nodes", "0", "--rate", "100mbit", "--", "true"], "--nodes"),
    (["--nodes", "2", "--rate", "100mbit"], "no command"),
    (["--nodes", "2", "--servers", "1", "--torchrun", "--rate", "1mbit", "--", "true"],
     "--torchrun"),
    (["--nodes", "2", "--min-workers", "3", "--rate", "1mbit", "--", "true"],
     "--min-workers=3 out of range: expected 1 to --nodes (2)"),
    (["--nodes", "2", "--min-workers", "1", "--torchrun", "--rate", "1mbit", "--", "true"],
     "--min-workers needs bps mode"),
])
def test_cli_rejects_bad_arguments(args, needle):
    before = namespaces_if_visible()
    done = _cli(args)
    assert done.returncode == 2
    assert needle in done.stderr
    assert_built_nothing(before)


def test_cli_needs_root(monkeypatch, capsys):
    """Not root: a clear error and exit code 2 before anything is built."""
    from bps.launch import netem

    before = namespaces_if_visible()
    if os.geteuid() == 0:
        # the interpreter lives under /root, so no other user can run it: fake the uid
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netem.main(["--nodes", "2", "--rate", "1mbit", "--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.undo()
    assert_built_nothing(before)


def test_cli_needs_ip_and_tc():
    if os.geteuid() != 0:
        pytest.skip("the root check comes first")
    env = dict(os.environ, PATH="/nonexistent")
    done = _cli(["--nodes", "2", "--rate", "1mbit", "--", sys.executable, "-c", "pass"],
                env=env)  # a command that exists, named by its path
    assert done.returncode == 2
    assert "iproute2" in done.stderr and "ip, tc" in done.stderr


# --------------------------------------------------------------------------- namespaces

@pytest.fixture(scope="module")
def netns_allowed():
    problem = support_problem()
    if problem:
        pytest.skip(f"network namespaces not usable here: {problem}")


@pytest.fixture
def sole_cleaner():
    """No other test process starts a netem run meanwhile: its start would remove the
    namespaces of the dead run that this test leaves for its own run to remove."""
    with netem_runs(exclusive=True):
        yield


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment carries the test's marker."""
    found = []
    needle = f"{MARKER_VAR}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _of_another_cluster(namespace: str, marker: str) -> bool:
    """Whether ``namespace`` (``bpsn-<launcher pid>-...``) belongs to a launcher that is
    alive and was not started by this test: a cluster someone else runs on the machine."""
    pid = namespace[len(PREFIX):].split("-", 1)[0]
    try:
        environ = Path(f"/proc/{int(pid)}/environ").read_bytes()
    except (ValueError, OSError):
        return False  # no such launcher any more: a leftover, whoever made it
    return f"{MARKER_VAR}={marker}".encode() not in environ


@pytest.fixture
def leftovers(netns_allowed):
    """Yields a marker for the launched processes' environment; then checks for leftovers."""
    marker = f"bpsn-test-{uuid.uuid4().hex[:12]}"
    namespaces_before = {ns for ns in list_namespaces() if ns.startswith(PREFIX)}
    links_before = _root_links()
    yield marker
    new = {ns for ns in list_namespaces() if ns.startswith(PREFIX)} - namespaces_before
    assert {ns for ns in new if not _of_another_cluster(ns, marker)} == set()
    assert _root_links() <= links_before
    assert _processes_with(marker) == []


THROUGHPUT_PEER = textwrap.dedent("""
    # Rank 0 receives NBYTES from rank 1, then sends NBYTES back; each side
    # measures what it received, from its first to its last chunk.
    import json, os, socket, sys, time
    out_dir, nbytes = sys.argv[1], int(sys.argv[2])
    rank, master = int(os.environ["RANK"]), os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"]) + 1

    def receive(conn):
        total, first, last, first_len = 0, None, None, 0
        while total < nbytes:
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise SystemExit("peer closed early")
            now = time.perf_counter()
            if first is None:
                first, first_len = now, len(chunk)
            total, last = total + len(chunk), now
        return (total - first_len) * 8 / (last - first)

    if rank == 0:
        server = socket.create_server((master, port))
        server.settimeout(60)
        conn, _ = server.accept()
    else:
        deadline = time.monotonic() + 60
        while True:  # rank 0 may not listen yet: retry until it does, bounded
            try:
                conn = socket.create_connection((master, port), timeout=60)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    conn.settimeout(60)
    if rank == 1:
        conn.sendall(bytes(nbytes))
    rate = receive(conn) if rank == 0 else None
    if rank == 0:
        conn.sendall(bytes(nbytes))
    else:
        rate = receive(conn)
    own_ip = [a for a in os.popen("ip -4 -o addr show dev eth0").read().split() if "/" in a]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"bits_per_second": rate, "ip": own_ip,
                   "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}, f)
""")


@pytest.mark.netns
def test_throughput_matches_configured_rate(leftovers, tmp_path):
    """Two emulated hosts at 20 Mbit/s: TCP goodput both ways within 20% of the rate."""
    rate = 20_000_000
    script = tmp_path / "peer.py"
    script.write_text(THROUGHPUT_PEER)
    stats = tmp_path / "stats.json"
    nbytes = rate // 8 * 3  # about 3 s per direction
    done = _cli(["--nodes", "2", "--rate", "20mbit", "--torchrun", "--stats-json", str(stats),
                 "--", sys.executable, str(script), str(tmp_path), str(nbytes)], leftovers)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert abs(result["bits_per_second"] - rate) <= 0.2 * rate, result
        assert result["gloo_ifname"] == "eth0"
        assert result["ip"][0].startswith("10.77.0.")
    hosts = json.loads(stats.read_text())["hosts"]
    # each host sent its nbytes of payload plus TCP/IP headers through its shaped link
    for name in ("w0", "w1"):
        assert nbytes <= hosts[name]["tx_bytes"] <= nbytes * 1.1
        assert nbytes <= hosts[name]["rx_bytes"] <= nbytes * 1.1


@pytest.mark.netns
def test_unshaped_link_is_much_faster(netns_allowed):
    """Sanity of the measurement itself: without tbf the same transfer is far above 20 Mbit/s."""
    from bps.launch.throughput import measure_throughput

    with EmulatedCluster(["a", "b"], LinkShape(rate_bits=None)) as cluster:
        rate = measure_throughput(cluster.hosts["a"], cluster.hosts["b"], 20_000_000)
    assert rate > 100e6


BURST_RECEIVER = textwrap.dedent("""
    # Accept N connections, read everything, print the byte count.
    import socket, sys
    ip, n = sys.argv[1], int(sys.argv[2])
    server = socket.create_server((ip, 0))
    server.settimeout(60)
    print(server.getsockname()[1], flush=True)
    conns = [server.accept()[0] for _ in range(n)]
    total = 0
    for conn in conns:
        conn.settimeout(60)
        while chunk := conn.recv(1 << 16):
            total += len(chunk)
    print(total, flush=True)
""")

BURST_SENDER = textwrap.dedent("""
    # Open N connections, then write NBYTES on each at once (one thread per connection).
    import socket, sys, threading
    ip, port, n, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    conns = [socket.create_connection((ip, port), timeout=60) for _ in range(n)]
    threads = [threading.Thread(target=c.sendall, args=(bytes(nbytes),)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()
""")


def _qdisc_drops(netns: str, dev: str) -> int:
    done = subprocess.run(["tc", "-s", "-j", "-n", netns, "qdisc", "show", "dev", dev],
                          capture_output=True, text=True, check=True, timeout=30)
    return sum(q.get("drops", 0) for q in json.loads(done.stdout))


@pytest.mark.netns
def test_a_host_queues_its_own_burst_instead_of_dropping_it(netns_allowed):
    """8 TCP connections write 64 KB each at once from an 8 Mbit/s host: 512 KB, ten
    times the 50 ms of queue the switch side keeps. Like a NIC's transmit queue, the
    host side holds it all: no packet is dropped there (with a 50 ms queue even the
    first round trip's initial windows, 8 x 10 frames, overflow it)."""
    connections, nbytes = 8, 64 * 1024
    with EmulatedCluster(["a", "b"], LinkShape(rate_bits=8_000_000)) as cluster:
        a, b = cluster.hosts["a"], cluster.hosts["b"]
        receiver = subprocess.Popen(
            b.exec_argv([sys.executable, "-c", BURST_RECEIVER, b.ip, str(connections)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            port = receiver.stdout.readline().strip()
            assert port.isdigit(), receiver.stderr.read()
            sender = subprocess.run(
                a.exec_argv([sys.executable, "-c", BURST_SENDER, b.ip, port,
                             str(connections), str(nbytes)]),
                capture_output=True, text=True, timeout=60)
            assert sender.returncode == 0, sender.stderr
            out, err = receiver.communicate(timeout=60)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        assert receiver.returncode == 0, err
        assert int(out.split()[-1]) == connections * nbytes
        assert _qdisc_drops(a.netns, a.ifname) == 0


@pytest.mark.netns
def test_failure_of_one_node_stops_everything(leftovers):
    code = textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)   # the launcher must kill this one
    """)
    done = _cli(["--nodes", "2", "--rate", "10mbit", "--torchrun", "--",
                 sys.executable, "-c", code], leftovers)
    assert done.returncode != 0


def _start_sleepers(marker: str, nodes: int = 2) -> subprocess.Popen:
    """bpslaunch netem running one sleeper per node; returns once all of them run."""
    code = "import os, time; print('ready', os.environ['RANK'], flush=True); time.sleep(600)"
    launcher = subprocess.Popen(NETEM + ["--nodes", str(nodes), "--rate", "10mbit",
                                             "--torchrun", "--", sys.executable, "-c", code],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO, env=dict(os.environ, **{MARKER_VAR: marker}),
                                preexec_fn=default_sigint)
    seen = []
    for line in launcher.stdout:
        seen.append(line)
        if sum("ready" in s for s in seen) == nodes:
            return launcher
    launcher.wait(timeout=TIMEOUT)
    raise AssertionError("sleepers never started:\n" + "".join(seen))


@pytest.mark.netns
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_tears_everything_down(leftovers, signum):
    launcher = _start_sleepers(leftovers)
    try:
        assert len(_processes_with(leftovers)) >= 3  # the launcher and two sleepers
        launcher.send_signal(signum)
        assert launcher.wait(timeout=TIMEOUT) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.netns
def test_stale_cluster_is_removed_by_next_run(leftovers, sole_cleaner):
    launcher = _start_sleepers(leftovers)
    launcher.kill()  # SIGKILL: no chance to clean up
    launcher.wait(timeout=TIMEOUT)
    stale = [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}{launcher.pid}-")]
    assert sorted(stale) == sorted(f"{PREFIX}{launcher.pid}-{h}" for h in ("w0", "w1", "sw"))
    done = _cli(["--nodes", "1", "--rate", "10mbit", "--torchrun", "--", "true"])
    assert done.returncode == 0, done.stderr
    assert "dead run" in done.stderr


@pytest.mark.netns
def test_clean_stale_kills_processes_left_inside(leftovers, sole_cleaner):
    """A dead owner's namespace that still has a process in it: killed, then deleted."""
    owner = subprocess.Popen(["true"])
    owner.wait()  # a pid that no longer runs
    netns = f"{PREFIX}{owner.pid}-w0"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c",
                               "import time; print('ready', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, **{MARKER_VAR: leftovers}))
    try:
        assert orphan.stdout.readline().strip() == "ready"  # it runs inside the namespace
        removed = clean_stale()
        assert netns in removed
        assert orphan.wait(timeout=TIMEOUT) != 0
        assert netns not in list_namespaces()
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        subprocess.run(["ip", "netns", "delete", netns], capture_output=True)


@pytest.mark.netns
def test_training_steps_through_emulated_network(leftovers, tmp_path):
    """bps training on 2 emulated nodes of 2 processes + 1 server: it learns, and its pushes
    cross the shaped links (the intra-node reduction stays inside each namespace)."""
    metrics, stats = tmp_path / "metrics.json", tmp_path / "netem.json"
    done = _cli(["--nodes", "2", "--servers", "1", "--local-size", "2", "--rate", "20mbit",
                 "--stats-json", str(stats),
                 "--", sys.executable, "examples/mnist.py", "--epochs", "1", "--hidden", "64",
                 "--compressor", "onebit", "--ef", "vanilla", "--momentum", "nesterov",
                 "--min-compress-bytes", "0", "--metrics-json", str(metrics)], leftovers)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(metrics.read_text())
    assert result["workers"] == 4
    assert len(result["steps"]) == 4000 // 4 // 32
    assert result["epochs"][0]["test_accuracy"] > 0.6  # ten classes: chance is 0.1
    hosts = json.loads(stats.read_text())["hosts"]
    pushed = result["totals"]["bytes_pushed"]  # node 0's payload bytes, as bps counts them
    assert pushed > 0
    # the kernel's counters of the emulated interfaces saw at least that much
    assert hosts["w0"]["tx_bytes"] >= pushed
    assert hosts["s0"]["rx_bytes"] >= 2 * pushed * 0.9  # both nodes push about the same
    assert "10.77.0." in done.stdout  # addresses the processes advertised to each other


@pytest.mark.netns
def test_too_many_hosts_is_a_clear_error(netns_allowed):
    before = set(list_namespaces())
    done = _cli(["--nodes", "300", "--rate", "1mbit", "--", "true"])
    assert done.returncode == 2
    assert "at most 250 hosts" in done.stderr and "Traceback" not in done.stderr
    assert set(list_namespaces()) == before


@pytest.mark.netns
@pytest.mark.slow
def test_slow_network_runner_quick(leftovers, tmp_path):
    """bench/slow_network.py --quick: every run succeeds, results and figures are written,
    and onebit puts far fewer bytes on the emulated wire than fp32 (kernel counters).
    Every run (bps and DDP) uses the default cosine schedule."""
    done = subprocess.run([sys.executable, "bench/slow_network.py", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=REPO,
                          env=dict(os.environ, **{MARKER_VAR: leftovers}))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| method | step time | time to target | final accuracy | bytes per step" in done.stdout
    assert "left" in done.stdout  # the per-run progress lines with an estimate
    record = json.loads((tmp_path / "slow_network_100mbit_quick.json").read_text())
    rows = {row["method"]: row for row in record["rows"]}
    assert set(rows) == {"fp32", "onebit", "ddp-powersgd"}
    job = dict(zip(record["job"][::2], record["job"][1::2], strict=True))
    assert job["--lr-schedule"] == "cosine"  # every run, bps and DDP, decays the lr alike
    for run in record["runs"]:
        assert run["metrics"]["args"]["lr_schedule"] == "cosine"
    for row in rows.values():
        assert row["exit_code"] == 0 and row["final_accuracy"] > 0.5 and row["step_time_s"] > 0
    assert rows["onebit"]["wire_bytes_per_step"] < rows["fp32"]["wire_bytes_per_step"] / 5
    for suffix in (".csv", "_accuracy.png", "_step_time.png"):
        assert (tmp_path / f"slow_network_100mbit_quick{suffix}").stat().st_size > 0


def _saved_target(record: dict) -> float:
    """A saved table's target accuracy: its fp32 run's final accuracy minus 1 point."""
    fp32 = next(r for r in record["runs"] if r["method"] == "fp32")
    return fp32["metrics"]["epochs"][-1]["test_accuracy"] - 0.01


def _saved_time_to(run: dict, target: float) -> float:
    """A saved run's wall time at its first epoch end reaching ``target`` (inf: never)."""
    return next((e["wall_time"] for e in run["metrics"]["epochs"]
                 if e["test_accuracy"] >= target), float("inf"))


def test_slow_network_partial_rerun_takes_the_target_of_a_baseline(tmp_path):
    """--baseline: a table without fp32 (here rebuilt with --from-json from a saved
    table's first compressed run) gets fp32's target and speed-ups from a saved full table; a
    baseline of another network is refused before anything runs, naming the field."""
    table = DATA / "slow_network_100mbit_b6f9905.json"
    record = json.loads(table.read_text())
    fp32 = next(r for r in record["runs"] if r["method"] == "fp32")
    target = _saved_target(record)

    # the table's first run through a compressor, alone
    first = next(r for r in record["runs"] if "--compressor" in r["args"]
                 and r["args"][r["args"].index("--compressor") + 1] != "none")
    partial = dict(record, runs=[first])
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    base = [sys.executable, "bench/slow_network.py", "--from-json", str(tmp_path / "partial.json"),
            "--out", str(tmp_path / "out")]
    done = subprocess.run(base + ["--baseline", str(table)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "slow_network_100mbit.json").read_text())["rows"]
    assert [r["method"] for r in rows] == [first["method"]]
    assert rows[0]["time_to_target_s"] == _saved_time_to(first, target)
    assert rows[0]["speedup_vs_fp32"] == pytest.approx(
        _saved_time_to(fp32, target) / _saved_time_to(first, target))
    # without it, the only run sets its own target (final - 1 point): not the table's
    done = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=REPO)
    rows = json.loads((tmp_path / "out" / "slow_network_100mbit.json").read_text())["rows"]
    assert rows[0]["speedup_vs_fp32"] == 1.0

    other = DATA / "slow_network_none_b6f9905.json"
    done = subprocess.run(base + ["--baseline", str(other)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 2
    assert "--baseline" in done.stderr and "field 'rate' is 'none'" in done.stderr


@pytest.mark.parametrize("table", ["slow_network_100mbit_b8484ef.json",
                                   "slow_network_100mbit_b6f9905.json"])
def test_runner_reports_the_best_bps_method_against_powersgd(tmp_path, table):
    """The runner's summary names bps's fastest method to the target and its ratio to DDP +
    PowerSGD's time, against the goal; recomputed here from the saved epochs."""
    record = json.loads((DATA / table).read_text())
    runs = {r["method"]: r for r in record["runs"]}
    target = _saved_target(record)

    bps_names = {"fp32", "fp16", "onebit", "topk", "randomk", "dithering"}
    best = min((runs[name] for name in bps_names if name in runs),
               key=lambda run: _saved_time_to(run, target))
    ratio = _saved_time_to(runs["ddp-powersgd"], target) / _saved_time_to(best, target)
    done = subprocess.run([sys.executable, "bench/slow_network.py", "--from-json",
                           str(DATA / table), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("against DDP + PowerSGD"))
    assert f"{best['label']} reaches the target {ratio:.2f}x sooner" in line
    goal = 2  # at 100 Mbit/s (3 at 20 Mbit/s, 1.5 on other links)
    assert line.endswith(f"goal {goal}x, met)" if ratio >= goal else f"goal {goal}x, not met)")


def test_the_docs_baseline_commands_find_their_baseline(monkeypatch):
    """Every ``bench/slow_network.py ... --baseline PATH`` of docs/slow_network.md, as
    typed, in a fresh clone: the file is there (not in the ignored bench/results/) and
    is a record of the command's own job, which the runner checks before it starts."""
    import shlex

    spec = importlib.util.spec_from_file_location("slow_network", BENCH / "slow_network.py")
    runner = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "slow_network", runner)  # its dataclasses look it up
    spec.loader.exec_module(runner)
    text = (REPO / "docs" / "slow_network.md").read_text().replace("\\\n", " ")
    commands = [line.split("bench/slow_network.py", 1)[1] for line in text.splitlines()
                if "bench/slow_network.py" in line and "--baseline" in line]
    assert commands
    for command in commands:
        args = runner.parse_args(shlex.split(command, comments=True))
        path = REPO / args.baseline
        assert path.is_file() and "results" not in path.parts, command
        assert runner.load_baseline(path, args).method.name == "fp32", command


def test_runner_partition_sizes_follow_the_link(monkeypatch):
    """Compressed runs get 2 MB partitions on a limited link and BytePS's 4 MB unthrottled,
    where per-message CPU sets the step; uncompressed runs 1 MB; a given size wins."""
    spec = importlib.util.spec_from_file_location("slow_network",
                                                  BENCH / "slow_network.py")
    runner = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "slow_network", runner)  # its dataclasses look it up
    spec.loader.exec_module(runner)
    cases = [([], 2048000), (["--rate", "20mbit"], 2048000), (["--rate", "none"], 4096000),
             (["--rate", "none", "--compressed-partition-bytes", "1000000"], 1000000),
             (["--compressed-partition-bytes", "3000000"], 3000000)]
    for argv, expected in cases:
        args = runner.parse_args(argv)
        sizes = {m.name: m.partition_bytes(args) for m in args.method_list}
        assert sizes["fp32"] == sizes["fp16"] == 1024000, argv
        assert {sizes[m] for m in ("onebit", "topk", "randomk", "dithering")} == {expected}, argv


WARM_AND_COUNT = """
import json
import numba.core.registry
import slow_network
args = slow_network.parse_args(["--methods", "fp32,onebit",
                                "--compressed-partition-bytes", "800000"])
slow_network.warm_kernels(args, args.method_list)
from bps.compressors import error_feedback, finite, momentum, onebit
counts = {"hits": 0, "misses": 0}
for module in (error_feedback, finite, momentum, onebit):
    for value in vars(module).values():
        if isinstance(value, numba.core.registry.CPUDispatcher):
            counts["hits"] += sum(value.stats.cache_hits.values())
            counts["misses"] += sum(value.stats.cache_misses.values())
print(json.dumps(counts))
"""


def test_runner_compiles_the_kernels_before_its_runs(tmp_path):
    """warm_kernels runs each compressed method's worker and server chains once, so numba
    compiles their kernels into its on-disk cache before any run is timed: a fresh
    process making the same calls then loads every kernel and compiles none."""
    # bench/ on the path: the script imports slow_network as a module
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH),
                                                       os.environ.get("PYTHONPATH")]))}
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", WARM_AND_COUNT], capture_output=True,
                              text=True, timeout=300, cwd=REPO, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        counts.append(json.loads(done.stdout.splitlines()[-1]))
    assert counts[0]["misses"] > 5  # the first process compiled them
    # the second loads what the first compiled (the kernels called from those come with
    # them) and compiles nothing
    assert counts[1]["misses"] == 0 and counts[1]["hits"] >= counts[0]["misses"]


@pytest.mark.netns
def test_delay_needs_netem(leftovers):
    """--delay works where the kernel has netem; elsewhere a clear error before anything runs."""
    from bps.launch.netns import netem_missing_reason

    missing = netem_missing_reason()
    done = _cli(["--nodes", "1", "--rate", "10mbit", "--delay", "1ms", "--torchrun", "--",
                 "true"], leftovers)
    if missing:
        assert done.returncode == 2
        assert "no netem qdisc" in done.stderr and "--delay" in done.stderr
    else:
        assert done.returncode == 0, done.stderr


# test_local_job_gives_workers_torch_distributed_variables (tests/launch/test_cluster.py)
# covers the job, and test_training_steps_through_emulated_network bps mode on emulated hosts
@pytest.mark.slow
@pytest.mark.netns
def test_default_process_group_works_in_a_bps_job(leftovers):
    """bps mode gives every worker process torch.distributed's variables (MASTER_ADDR =
    node 0's emulated address): tests/harness/cluster_job.py's dist.init_process_group() with no
    arguments spans both nodes next to bps.init() and checks the trainer against it."""
    done = _cli(["--nodes", "2", "--servers", "1", "--local-size", "2", "--rate", "1gbit",
                 "--", sys.executable, str(HARNESS / "cluster_job.py")], leftovers)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = sorted(int(fields[0]) for fields in ok_fields(done.stdout))
    assert ranks == [0, 1, 2, 3], done.stdout[-3000:]


def test_runner_model_flag_reaches_both_scripts_and_names_the_results(monkeypatch, tmp_path):
    """--model cnn: bps and DDP runs get it in the job's flags (the MLP's shape left out),
    the parameter count comes from the CNN's builder, results are named slow_network_cnn_*;
    the default MLP job keeps the flags and names of the saved tables."""
    spec = importlib.util.spec_from_file_location("slow_network", BENCH / "slow_network.py")
    runner = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "slow_network", runner)  # its dataclasses look it up
    spec.loader.exec_module(runner)
    mlp = runner.parse_args(["--out", str(tmp_path)])
    saved = json.loads((DATA / "slow_network_100mbit_b6f9905.json").read_text())
    assert runner.job_args(mlp) == saved["job"] and "--model" not in runner.job_args(mlp)
    assert runner.parameter_count(mlp) == 2085610
    assert runner.results_stem(mlp) == tmp_path / "slow_network_100mbit"

    cnn = runner.parse_args(["--quick", "--model", "cnn", "--rate", "20mbit",
                             "--out", str(tmp_path)])
    job = runner.job_args(cnn)
    assert job[job.index("--model") + 1] == "cnn" and "--hidden" not in job
    assert runner.parameter_count(cnn) == 317066
    assert runner.results_stem(cnn) == tmp_path / "slow_network_cnn_20mbit_quick"
    methods = runner.all_methods()
    for name in ("fp32", "ddp-powersgd"):
        argv = runner.command(methods[name], cnn, tmp_path / "m.json", tmp_path / "s.json")
        assert argv[argv.index("--model") + 1] == "cnn", name


def test_runner_streaming_rows_carry_their_mode_flags(monkeypatch):
    """The -stream rows pass --sync-every, --fragments and --overlap (overlap H/F unless
    given) to examples/mnist.py, and the kernels' warm-up sees only the compression flags."""
    spec = importlib.util.spec_from_file_location("slow_network", BENCH / "slow_network.py")
    runner = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "slow_network", runner)  # its dataclasses look it up
    spec.loader.exec_module(runner)
    stream = runner.all_methods(sync_every=16, fragments=4)["onebit-stream"]
    assert stream.args == ("--compressor", "onebit", "--ef", "vanilla", "--sync-every", "16",
                           "--outer", "average", "--fragments", "4", "--overlap", "4")
    assert stream.compression_args == ["--compressor", "onebit", "--ef", "vanilla"]
    args = runner.parse_args(["--methods", "topk-stream", "--sync-every", "32",
                              "--overlap", "8"])
    assert args.method_list[0].args[-4:] == ("--fragments", "4", "--overlap", "8")
