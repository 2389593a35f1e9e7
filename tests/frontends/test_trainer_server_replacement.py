"""Server replacement with the trainer (``bpslaunch local --spare-servers``): server 1
killed with SIGKILL at the start of a step, its keys move to a spare (or to a server
started again with its environment); the job finishes, both worker nodes bit-identical
to each other and to the numpy replay: the step in flight dropped everywhere, the server
error feedback of the moved keys restarting at zero; the same with a worker node of
three dead in that step too, the survivors' divisions following. Without a replacement
the job fails naming the dead server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.harness.trainer_job import (
    SHAPES,
    SIM_CASES,
    launch,
    load_reports,
    plain,
    replay,
)

COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
PARAMS = {**SIM_CASES["topk"], **COMMON}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25]  # powers of two: lr * g is exact everywhere
WORKERS = 2
AT = 2  # server 1 dies at the start of this step
# the keys on server 1: three partitions of "big" (compressed, the same payload bound)
# and the fused raw key go largest first onto the least-loaded server (plan_key_servers):
# partitions 0, 1, 2 to servers 0, 1, 0, the raw key (no server chain) to server 1
MOVED = [1]


def run(tmp_path, spares: int, restart: bool = False, env: dict | None = None,
        workers: int = WORKERS, options: tuple[str, ...] = (), **more):
    """Server 1 killed at the start of step AT (``more``: more of the job's config)."""
    cfg = {"runs": [{"params": PARAMS}], "lrs": LRS, "stop": len(LRS),
           "kill_server": [1, AT, "restart"] if restart else [1, AT], **more}
    return launch(cfg, tmp_path, workers=workers, servers=2, env=env, timeout=150,
                  options=("--spare-servers", str(spares), *options))


def check_workers(tmp_path, workers: int = WORKERS, survivors: int = WORKERS) -> None:
    """Nodes ``0 .. survivors - 1`` of ``workers`` end as the replay: steps before AT
    with every node; AT dropped everywhere; from AT + 1 on the survivors, the moved
    partitions' server chains anew."""
    members = [list(range(workers))] * AT + [None] + \
        [list(range(survivors))] * (len(LRS) - AT - 1)
    want = replay(PARAMS, workers, LRS, plain(SHAPES), members=members,
                  fresh_servers={AT + 1: MOVED})
    # the replay tells the reset apart: without it the moved partition would differ
    kept = replay(PARAMS, workers, LRS, plain(SHAPES), members=members)
    assert not np.array_equal(kept["big"], want["big"])
    for rank in range(survivors):
        final = np.load(tmp_path / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], want[n], err_msg=f"rank {rank}: {n}")


def test_a_spare_takes_the_keys_of_a_killed_server(tmp_path):
    """kill -9 of server 1 at the start of step 2 with one spare: the job exits 0, the
    workers match the replay; the spare was told, the workers reconnected."""
    result = run(tmp_path, spares=1)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    check_workers(tmp_path)
    assert "server 1 at tcp://127.0.0.1" in out and "died: its connection to the " \
        "scheduler closed: server 1 is now served from" in out, out[-4000:]
    assert "membership generation 1" in out
    for node in range(WORKERS):  # (requests in flight to the dead server: sent again)
        assert re.search(rf"node {node}: .*server 1 is now served from .*; \d+ key\(s\) "
                         r"declared there again, \d+ request\(s\) sent again", out), \
            out[-4000:]
    assert "PEER_DEAD" not in out and "ClusterError" not in out, out[-4000:]


# no spare: [1] covers the departure then the replacement, and
# test_a_restarted_server_takes_the_slot_of_the_one_killed a restarted server taking the slot
@pytest.mark.parametrize("spares", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_worker_node_and_a_server_that_die_together_cost_one_step(tmp_path, spares):
    """Three nodes, ``--min-workers 2``, node 2 and server 1 dead at the start of step
    2. One spare: node 2 kills itself and, once its departure is announced (membership
    generation 1), rank 0 kills server 1 before pushing anything of step 2; the spare
    takes the slot at once. No spare: node 2 kills server 1, starts it again (which
    imports torch: seconds) and kills itself: it leaves before the restart takes the slot.
    Either way the replacement comes at generation 2, the job exits 0, step 2 is the
    only one skipped, and nodes 0 and 1 match the replay: node 2 gone from step 2 on,
    server 1's keys' chains anew."""
    more = {"kill_server_after": 1} if spares else {"kill_server_by": 2}
    try:
        result = run(tmp_path, spares, restart=not spares, env={"BPS_HEARTBEAT_TIMEOUT": "15"},
                     workers=3, options=("--min-workers", "2"),
                     leave=[2, AT, "SIGKILL"], **more)
        out = result.stdout
        assert result.returncode == 0, out[-6000:]
        departure = "worker nodes [0, 1] go on (membership generation 1)"
        assert departure in out, out[-6000:]
        left = out.index(departure)  # then the replacement
        assert re.search(r"server 1 is now served from \S+ \(membership generation 2\)",
                         out[left:]), out[-6000:]
        for rank, report in enumerate(load_reports(tmp_path, 2)):
            skipped = [step["skipped"] for step in report[""]["steps"]]
            assert skipped == [step == AT for step in range(len(LRS))], (rank, skipped)
        check_workers(tmp_path, workers=3, survivors=2)
    finally:
        _stop(tmp_path / "restarted.pid")


@pytest.mark.slow  # the engine is the same in the agent: the test above covers it
def test_under_the_node_agent_a_spare_takes_the_keys_too(tmp_path):
    """BPS_NODE_AGENT=1: the agents' engines reconnect; the same replay."""
    result = run(tmp_path, spares=1, env={"BPS_NODE_AGENT": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    check_workers(tmp_path)


def test_a_restarted_server_takes_the_slot_of_the_one_killed(tmp_path):
    """No spare (``--spare-servers 0``): the server started again with the dead one's
    environment registers after the job began and takes slot 1; the same replay."""
    try:
        # the restart imports torch on a loaded host: its slot may wait 15 s for it
        result = run(tmp_path, spares=0, restart=True, env={"BPS_HEARTBEAT_TIMEOUT": "15"})
        out = result.stdout
        assert result.returncode == 0, out[-4000:]
        check_workers(tmp_path)
        assert "its slot waits up to" in out, out[-4000:]
        assert "server 1 is now served from" in out, out[-4000:]
        log = (tmp_path / "restarted.log").read_text()
        assert "server 1 serving on" in log, log[-3000:]
        pid = int((tmp_path / "restarted.pid").read_text())
        deadline = time.monotonic() + 20  # it ends with the job (SHUTDOWN)
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), log[-3000:]
    finally:
        _stop(tmp_path / "restarted.pid")


# tests/server/test_scheduler_replacement.py's
# test_a_slot_nobody_takes_fails_the_job_naming_the_dead_server covers the rule and its message
@pytest.mark.slow
def test_without_a_replacement_the_job_fails_naming_the_server(tmp_path):
    """``--spare-servers 0`` and nothing started again: the slot waits
    BPS_HEARTBEAT_TIMEOUT, then the job fails naming server 1 (6 s: long enough that no
    starved process of a loaded host misses it first)."""
    result = run(tmp_path, spares=0, env={"BPS_HEARTBEAT_TIMEOUT": "6"})
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    assert "server 1 at tcp://127.0.0.1" in out and "no server took its place" in out, \
        out[-4000:]


@pytest.mark.parametrize(("flag", "env", "message"), [
    (("--spare-servers", "-1"), {}, "--spare-servers=-1 out of range: expected 0 to 64"),
    (("--spare-servers", "65"), {}, "--spare-servers=65 out of range: expected 0 to 64"),
    ((), {"BPS_SPARE_SERVERS": "two"}, "BPS_SPARE_SERVERS='two' is not an integer"),
])
def test_a_bad_spare_count_is_refused_before_anything_starts(flag, env, message):
    from tests.harness.ps_job import BPSLAUNCH

    result = subprocess.run([*BPSLAUNCH, "local", *flag, "--", "true"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **env})
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert "[scheduler]" not in result.stdout  # nothing started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _stop(pid_file) -> None:
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass

