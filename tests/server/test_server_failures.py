"""Failure behaviour with real processes started one by one (no fail-fast launcher in
between): a dead worker, a dead server or a node that never arrives makes every other
process exit non-zero with an error naming it, within the heartbeat timeout.

``test_every_role_that_fails_is_named_within_the_heartbeat_timeout`` times it: from the
signal the test sends to the moment each other process exits (seen by ``wait``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.harness.roles import HEARTBEAT_TIMEOUT, JOB

ROLE = [sys.executable, "-m", "bps.launch.cli"]

# startup (imports) + heartbeat timeout + slack for a loaded 2-core machine
EXIT_WITHIN = 60.0


# the [worker1-SIGKILL] case of test_every_role_that_fails_is_named_within_the_heartbeat_timeout
# covers it (and times it)
@pytest.mark.slow
def test_killed_worker_fails_everyone_naming_it(cluster) -> None:
    c = cluster(workers=2, servers=1)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server")
    c.worker(0)
    c.worker(1, "--kill-at", "3")
    code, out = c.wait("worker1", EXIT_WITHIN)
    assert code == -signal.SIGKILL, out
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "worker 1 at 127.0.0.1 died: no heartbeat" in out, (name, out)


# the [server0-SIGKILL] case of test_every_role_that_fails_is_named_within_the_heartbeat_timeout
# covers it (and times it)
@pytest.mark.slow
def test_killed_server_fails_everyone_naming_it(cluster) -> None:
    c = cluster(workers=2, servers=2)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server", BPS_SERVER_ID="0")
    victim = c.start("server1", ROLE, DMLC_ROLE="server", BPS_SERVER_ID="1")
    c.worker(0, "--kill-pid", str(victim.pid), "--kill-at", "3")
    c.worker(1)
    for name in ("scheduler", "server0", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "server 1 at tcp://127.0.0.1:" in out and "died" in out, (name, out)


def test_missing_worker_times_out_naming_it(cluster) -> None:
    c = cluster(workers=2, servers=1, timeout=8.0)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server")
    c.worker(0)
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "rendezvous timed out" in out and "workers missing: [1]" in out, (name, out)


def train_job(c, failing: int, how: str, at: int = 3) -> None:
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server")
    for node in range(2):
        c.start(f"worker{node}", [sys.executable, JOB, "--out", str(c.tmp_path), "--case",
                                  "train", "--fail", str(failing), how, str(at)],
                DMLC_ROLE="worker", DMLC_WORKER_ID=str(node))


@pytest.mark.parametrize(("how", "named"), [
    ("raise", "worker 1 at 127.0.0.1 failed: RuntimeError: boom at step 3"),
    # the same report as tests/launch/test_cluster.py's
    # test_a_failing_process_stops_every_launcher, where worker 1 exits with 3
    pytest.param("exit", "worker 1 at 127.0.0.1 failed: the process exited without calling "
                 "bps.shutdown()", marks=pytest.mark.slow),
    # the same failure report as an exception's ("raise")
    pytest.param("interrupt", "worker 1 at 127.0.0.1 failed: KeyboardInterrupt",
                 marks=pytest.mark.slow),
])
def test_a_worker_that_fails_is_named_by_everyone(cluster, how: str, named: str) -> None:
    """An exception, sys.exit(3) or Ctrl-C in worker 1 outside bpslaunch local: it tells
    the scheduler it failed (not that it finished), and every other process stops at once
    with an error naming it, instead of waiting for its next push."""
    c = cluster(workers=2, servers=1)
    train_job(c, 1, how)
    code, out = c.wait("worker1", EXIT_WITHIN)
    assert code != 0, out
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, HEARTBEAT_TIMEOUT + 30)
        assert code != 0, (name, out)
        assert named in out, (name, out)
    scheduler_log = c.wait("scheduler", 1)[1]
    assert "worker 0 at 127.0.0.1 died" not in scheduler_log  # never the healthy one
    assert "worker 0 at 127.0.0.1 failed" not in scheduler_log


def test_a_worker_whose_main_thread_hangs_is_named(cluster) -> None:
    """Its I/O thread heartbeats on, but its steps stop while worker 0 waits."""
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "hang")
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "worker 1 at 127.0.0.1 stopped stepping: its last push was of step 2" in out, \
            (name, out)


def test_a_server_that_stops_answering_is_named_by_the_push_that_waits(cluster) -> None:
    """Server 0 stops (SIGSTOP) long before its silence would be noticed (a heartbeat
    timeout of 120 s). Worker 1's push waiting for its reply fails at worker 1's
    BPS_TIMEOUT (10 s; worker 0 waits longer), naming its key and the server's endpoint
    its connection went to, and the whole job stops with that message. The server has
    two endpoints (two I/O threads), and the workers' connections are dealt over them in
    node order: worker 1's goes to the second, which the server logs second."""
    request_timeout = 10
    c = cluster(workers=2, servers=1, heartbeat_timeout=120.0)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server", BPS_IO_THREADS="2")
    for node, timeout in enumerate((60, request_timeout)):
        c.start(f"worker{node}", [sys.executable, JOB, "--out", str(c.tmp_path), "--case",
                                  "train", "--fail", "1", "none", "-1"],
                DMLC_ROLE="worker", DMLC_WORKER_ID=str(node), BPS_TIMEOUT=str(timeout),
                BPS_CONNECTIONS_PER_SERVER="1")
    ports = c.wait_for_line("server0", r"one endpoint each: ports (\d+), (\d+)").groups()
    for node in range(2):
        wait_for_line(c, f"worker{node}", f"worker {node}: training")
    os.kill(c.procs["server0"].pid, signal.SIGSTOP)
    named = re.compile(rf"push_pull of key \d+ \('[^']+'\) step \d+: no reply from server 0 "
                       rf"\(tcp://127\.0\.0\.1:(\d+)\) within {request_timeout} s "
                       rf"\(BPS_TIMEOUT\)")
    for name in ("worker1", "worker0", "scheduler"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        found = named.search(out)
        assert found and found[1] == ports[1], (name, ports, out)
        assert name == "worker1" or "worker 1 at 127.0.0.1 failed" in out, (name, out)


def test_workers_that_run_different_numbers_of_steps_get_a_clear_error(cluster) -> None:
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "finish")
    for name in ("scheduler", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "the workers ran different numbers of steps" in out, (name, out)


def test_workers_with_different_learning_rates_get_a_clear_error(cluster) -> None:
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "lr")
    for name in ("scheduler", "server0", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "the workers' learning rates differ" in out, (name, out)


def test_a_late_scheduler_is_waited_for(cluster) -> None:
    """Servers and workers started well before the scheduler (longer than the heartbeat
    timeout) wait for it up to BPS_TIMEOUT, as documented, and the job completes."""
    import subprocess

    c = cluster(workers=2, servers=1)
    c.start("server0", ROLE, DMLC_ROLE="server")
    for node in range(2):
        c.start(f"worker{node}", [sys.executable, JOB, "--out", str(c.tmp_path), "--case",
                                  "raw"], DMLC_ROLE="worker", DMLC_WORKER_ID=str(node))
    with pytest.raises(subprocess.TimeoutExpired):  # alive after the heartbeat timeout
        c.procs["worker1"].wait(timeout=HEARTBEAT_TIMEOUT + 2)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    for name in ("scheduler", "server0", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code == 0, (name, out)


def wait_for_line(c, name: str, text: str, timeout: float = EXIT_WITHIN) -> None:
    assert c.outputs[name].wait_for(text, timeout), (name, c.log(name))


# A short heartbeat timeout keeps these fast. Margins for a loaded 2-core machine: naming
# the failed node takes one more heartbeat interval and a loop turn; exiting afterwards
# takes the interpreter's teardown, which alone is 2-5 s for a process that imported torch
# at a load average of 10 here (nothing bps can shorten).
FAST_HEARTBEAT_TIMEOUT = 3.0
NAMED_MARGIN = 2.5
EXIT_MARGIN = 12.0
SERVER = "server 0 at tcp://127.0.0.1:"
WORKER = "worker 1 at 127.0.0.1 "


def exit_times(c, names: list[str], timeout: float) -> dict[str, tuple[int, float]]:
    """Wait for every process of ``names`` at once; name -> (exit code, when it exited
    by time.monotonic), as each one's ``wait`` returned."""
    seen: dict[str, tuple[int, float]] = {}

    def watch(name: str) -> None:
        try:
            code = c.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return
        seen[name] = (code, time.monotonic())

    threads = [threading.Thread(target=watch, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    return seen


@pytest.mark.parametrize(("victim", "how", "named"), [
    ("server0", signal.SIGKILL, "died: no heartbeat"),
    # a stopped process is a silent one, as a killed one: SIGKILL covers it in make test
    pytest.param("server0", signal.SIGSTOP, "died: no heartbeat", marks=pytest.mark.slow),
    ("server0", signal.SIGINT, "failed: KeyboardInterrupt"),  # raised inside its loop
    # a role's SIGTERM: worker1's covers the report, and tests/launch/test_cli.py's
    # test_a_role_stopped_while_it_exits_ends_without_a_traceback the role's handler
    pytest.param("server0", signal.SIGTERM, "failed: terminated by SIGTERM",
                 marks=pytest.mark.slow),
    ("scheduler", signal.SIGKILL, "unreachable: no heartbeat"),
    # a role's KeyboardInterrupt: server0's SIGINT covers the same code in make test
    pytest.param("scheduler", signal.SIGINT, "failed: KeyboardInterrupt",
                 marks=pytest.mark.slow),
    # the scheduler's silence rule is the same for every role (server0's SIGKILL times
    # it), and the peers' answer to worker 1's loss is worker1's SIGTERM's
    pytest.param("worker1", signal.SIGKILL, "died: no heartbeat", marks=pytest.mark.slow),
    # silence, as worker1's SIGKILL: the same heartbeat rule names it
    pytest.param("worker1", signal.SIGSTOP, "died: no heartbeat", marks=pytest.mark.slow),
    ("worker1", signal.SIGTERM, "failed: terminated by SIGTERM"),
], ids=lambda v: v.name if isinstance(v, signal.Signals) else None)
def test_every_role_that_fails_is_named_within_the_heartbeat_timeout(
        cluster, victim: str, how: signal.Signals, named: str) -> None:
    """kill -9, SIGSTOP, an exception (Ctrl-C's KeyboardInterrupt, raised wherever the
    main thread is) or SIGTERM of a server, the scheduler or a worker during training:
    every other process prints an error naming it within BPS_HEARTBEAT_TIMEOUT of the
    signal (plus a margin) and then exits non-zero; nobody blames a healthy node."""
    c = cluster(workers=2, servers=1, heartbeat_timeout=FAST_HEARTBEAT_TIMEOUT)
    train_job(c, 1, "none", at=-1)
    for node in range(2):
        wait_for_line(c, f"worker{node}", f"worker {node}: training")
    who = {"server0": SERVER, "worker1": WORKER,
           "scheduler": f"scheduler at tcp://127.0.0.1:{c.env['DMLC_PS_ROOT_PORT']} "}[victim]
    peers = [name for name in ("scheduler", "server0", "worker0", "worker1") if name != victim]
    sent = time.monotonic()
    os.kill(c.procs[victim].pid, how)
    exits = exit_times(c, peers, EXIT_WITHIN)
    if set(peers) - set(exits):  # every process's log, the victim's too, untruncated
        logs = "\n".join(f"--- {name} (exit code {proc.poll()}):\n{c.log(name)[-4000:]}"
                         for name, proc in c.procs.items())
        pytest.fail(f"{sorted(set(peers) - set(exits))} still running {EXIT_WITHIN:g} s "
                    f"after {how.name} to {victim}:\n{logs}")
    for name in peers:
        out = c.log(name)
        code, exited = exits[name]
        assert code != 0, (name, out)
        said = c.outputs[name].first(who, named)
        assert said is not None, (name, out)
        print(f"{name}: named {victim} {said - sent:.2f} s after {how.name}, exited after "
              f"{exited - sent:.2f} s")
        assert said - sent < FAST_HEARTBEAT_TIMEOUT + NAMED_MARGIN, (name, said - sent, out)
        assert exited - sent < FAST_HEARTBEAT_TIMEOUT + EXIT_MARGIN, (name, exited - sent, out)
    labels = [SERVER, WORKER, "worker 0 at 127.0.0.1 ", "scheduler at tcp://127.0.0.1:"]
    for healthy in (label for label in labels if not who.startswith(label)):
        blamed = re.compile(re.escape(healthy) + r"\S* ?(died|failed|unreachable|stopped)")
        for name in peers:
            assert not blamed.search(c.log(name)), (name, healthy, c.log(name))


@pytest.mark.parametrize("setting,why", [
    ({"DMLC_NUM_SERVER": "2"},
     "its DMLC_NUM_SERVER=2 differs from the scheduler's DMLC_NUM_SERVER=1"),
    ({"BPS_MIN_WORKERS": "1"},
     "its BPS_MIN_WORKERS=1 differs from the scheduler's BPS_MIN_WORKERS=unset"),
])
def test_a_node_with_another_job_setting_is_refused_and_named(cluster, setting, why) -> None:
    """A worker whose DMLC_NUM_SERVER or BPS_MIN_WORKERS differs from the scheduler's is
    refused at once, naming both values; the others' rendezvous timeout names its
    address and why (10 s: on a loaded host the refused worker's start alone, python and
    torch, can take 5)."""
    c = cluster(workers=2, servers=1, timeout=10.0)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server")
    c.worker(0)
    c.start("worker1", [sys.executable, JOB, "--out", str(c.tmp_path), "--case", "loop"],
            DMLC_ROLE="worker", DMLC_WORKER_ID="1", **setting)
    code, out = c.wait("worker1", EXIT_WITHIN)
    assert code != 0 and f"HELLO as worker 1: {why}" in out, out
    assert "rendezvous timed out" not in out, out  # at once, not after BPS_TIMEOUT
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert re.search(r"rendezvous timed out .*workers missing: \[1\]; .*refused: "
                         rf"127\.0\.0\.1 \(HELLO as worker 1: {re.escape(why)}", out), \
            (name, out)
