"""Launching the way clusters do: torchrun, SLURM and Kubernetes' PyTorchJob variables.

Each end-to-end test sets one launcher's variables for real processes on loopback and
runs tests/harness/cluster_job.py to completion: ``bps.init()``, the user's own
``dist.init_process_group("gloo")`` with no rendezvous arguments, and DistributedTrainer
steps checked against the mean gradient computed over that default group. On a GPU host,
the backend string docs/runtime.md gives for CPU and CUDA tensors is checked too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from bps.common.env import EnvError, derive_worker_env, launch_style, parse_nodelist
from bps.common.striping import host_cores
from bps.launch.role import free_port
from tests.harness.cluster_job import ok_fields
from tests.harness.paths import HARNESS
from tests.harness.ps_job import BPSLAUNCH, TEST_ENV, run_command

JOB = str(HARNESS / "cluster_job.py")
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]
# several launchers of torch processes share two cores: generous but finite waits
JOB_ENV = {**TEST_ENV, "BPS_TIMEOUT": "60", "BPS_HEARTBEAT_TIMEOUT": "15"}
CLUSTER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "DMLC_ROLE", "DMLC_NODE_HOST")


def run_all(jobs: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[tuple[int, str]]:
    """Start every (argv, env) at once (each its own process group, the test's cluster
    variables removed from the inherited environment), wait for all within ``timeout``;
    on any error kill every group so no process outlives the test."""
    base = {k: v for k, v in os.environ.items()
            if k not in CLUSTER_VARS and not k.startswith("SLURM_")}
    procs = [subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True, text=True)
             for argv, env in jobs]
    deadline = time.monotonic() + timeout
    try:
        results = []
        for proc in procs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{proc.args} did not finish within {timeout} s") from None
            results.append((proc.returncode, output))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def pipelines(results: list[tuple[int, str]]) -> list[str]:
    """Where each rank's gradient pipeline ran, from its ``cluster-job ok`` line."""
    return [fields[6] for _, out in results for fields in ok_fields(out)]


def finished(results: list[tuple[int, str]], world: int) -> None:
    """Every launcher exited 0 and each of the ``world`` ranks printed its line."""
    output = "\n".join(out for _, out in results)
    assert all(code == 0 for code, _ in results), output
    ranks = sorted(int(fields[0]) for fields in ok_fields(output))
    assert ranks == list(range(world)), output


# -- SLURM_JOB_NODELIST ---------------------------------------------------------------

@pytest.mark.parametrize("value, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu-a[9-10]", ["gpu-a9", "gpu-a10"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("single", ["single"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_nodelist_forms(value: str, hosts: list[str]) -> None:
    assert parse_nodelist(value) == hosts


@pytest.mark.parametrize("value", ["", "node[1-", "node]1", "node[3-1]", "node[a-b]", "[1-2]",
                                   "a,,b", "node[1-2]]"])
def test_malformed_nodelist_is_named(value: str) -> None:
    with pytest.raises(EnvError, match="SLURM_JOB_NODELIST"):
        parse_nodelist(value)


# -- deriving bps's variables ---------------------------------------------------------

def test_torchrun_variables_map_to_roles_and_ranks() -> None:
    env = derive_worker_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
                             "MASTER_PORT": "23456", "BPS_SERVERS_PER_NODE": "2"})
    assert {k: env[k] for k in ("DMLC_ROLE", "DMLC_WORKER_ID", "DMLC_NUM_WORKER",
                                "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
                                "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE",
                                "BPS_LOCAL_MASTER_PORT")} == {
        "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1", "DMLC_NUM_WORKER": "2",
        "DMLC_NUM_SERVER": "4", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "23457",
        "BYTEPS_LOCAL_RANK": "1", "BYTEPS_LOCAL_SIZE": "4", "BPS_LOCAL_MASTER_PORT": "23459"}


def test_pytorchjob_without_torchrun_is_one_process_per_node() -> None:
    env = derive_worker_env({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0",
                             "MASTER_PORT": "23456"})
    assert (env["DMLC_WORKER_ID"], env["DMLC_NUM_WORKER"], env["BYTEPS_LOCAL_SIZE"],
            env["LOCAL_RANK"]) == ("2", "3", "1", "0")


def test_slurm_variables_map_to_roles_ranks_and_torch_variables() -> None:
    env = derive_worker_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                             "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert (env["DMLC_WORKER_ID"], env["DMLC_NUM_WORKER"], env["BYTEPS_LOCAL_RANK"],
            env["BYTEPS_LOCAL_SIZE"], env["DMLC_PS_ROOT_URI"], env["DMLC_PS_ROOT_PORT"],
            env["DMLC_NODE_HOST"]) == ("1", "2", "1", "2", "gpu07", "29501", "gpu08")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"],
            env["MASTER_PORT"]) == ("3", "4", "1", "gpu07", "29500")


def test_dmlc_variables_take_precedence() -> None:
    assert launch_style({"DMLC_ROLE": "worker", "RANK": "0", "WORLD_SIZE": "1"}) == "dmlc"
    assert derive_worker_env({"DMLC_ROLE": "worker", "RANK": "0", "WORLD_SIZE": "1"}) == {}
    assert derive_worker_env({}) == {}


@pytest.mark.parametrize("environ, name", [
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "x", "MASTER_ADDR": "h"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h"},
     "LOCAL_WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "0"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "BPS_SERVERS_PER_NODE": "0"},
     "BPS_SERVERS_PER_NODE"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_NTASKS"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
      "SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_NODEID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}, "SLURM_JOB_NODELIST"),
])
def test_bad_cluster_variable_is_named(environ: dict[str, str], name: str) -> None:
    with pytest.raises(EnvError, match=name):
        derive_worker_env(environ)


def test_bpslaunch_names_a_bad_cluster_variable() -> None:
    code, output = run_command(BPSLAUNCH + [PY, "-c", "pass"],
                               {**JOB_ENV, "RANK": "0", "WORLD_SIZE": "2",
                                "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"},
                               timeout=60)
    assert code == 2 and "LOCAL_WORLD_SIZE" in output, output


# -- real jobs on loopback ------------------------------------------------------------

def test_local_job_gives_workers_torch_distributed_variables(monkeypatch) -> None:
    """bpslaunch local: dist.init_process_group("gloo") next to bps.init(), the rendezvous
    from the launcher's variables; with no OMP_NUM_THREADS of the user's, each of the 4
    worker processes gets the cores shared by them and the server, and torch uses it; so
    does the server's engine, with no BPS_SERVER_THREADS of the user's."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("BPS_SERVER_THREADS", raising=False)
    env = {k: v for k, v in JOB_ENV.items() if k != "BPS_SERVER_THREADS"}
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1",
                                            "--local-size", "2", "--", PY, JOB],
                               env, timeout=180)
    finished([(code, output)], 4)
    threads = str(max(1, host_cores() // 5))
    lines = ok_fields(output)
    assert all(line[4:] == [threads, threads, "process"] for line in lines), output
    assert f"OMP_NUM_THREADS={threads} for each worker process" in output, output
    assert f"BPS_SERVER_THREADS={threads} for each server" in output, output
    assert f"engine threads: {threads}\n" in output, output


# test_torchrun_variables_map_to_roles_and_ranks covers the variables torchrun sets, and
# test_local_job_gives_workers_torch_distributed_variables the job of 2 nodes x 2 processes
@pytest.mark.slow
@pytest.mark.parametrize("agent", [False, True], ids=["in process", "node agent"])
def test_torchrun_job(agent: bool) -> None:
    """Two torchrun agents (nodes) of two processes each, each process run by bpslaunch;
    with ``BPS_NODE_AGENT=1``, each node's local rank 0 starts a node agent that runs the
    gradient pipeline of both local ranks."""
    port = free_port()
    env = {**JOB_ENV, "DMLC_NODE_HOST": "127.0.0.1", "BPS_NODE_AGENT": str(int(agent))}
    jobs = [(TORCHRUN + ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                         "--master-addr", "127.0.0.1", "--master-port", str(port),
                         "--no-python"] + BPSLAUNCH + [PY, JOB], env) for node in range(2)]
    results = run_all(jobs, timeout=240)
    finished(results, 4)
    assert pipelines(results) == ["agent" if agent else "process"] * 4, results


# test_slurm_variables_map_to_roles_ranks_and_torch_variables covers the variables, and
# test_a_failing_process_stops_every_launcher a SLURM-style job on 127.0.0.1 and 127.0.0.2
@pytest.mark.slow
@pytest.mark.parametrize("agent", [False, True], ids=["in process", "node agent"])
def test_slurm_job(agent: bool) -> None:
    """srun --nodes 2 --ntasks-per-node 2 bpslaunch ...: the hosts are 127.0.0.1 and
    127.0.0.2, so node 1's server binds the second loopback address."""
    port = free_port()
    jobs = [(BPSLAUNCH + [PY, JOB],
             {**JOB_ENV, "SLURM_PROCID": str(task), "SLURM_NTASKS": "4",
              "SLURM_LOCALID": str(task % 2), "SLURM_NODEID": str(task // 2),
              "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "MASTER_PORT": str(port),
              "BPS_NODE_AGENT": str(int(agent))})
            for task in range(4)]
    results = run_all(jobs, timeout=240)
    finished(results, 4)
    assert pipelines(results) == ["agent" if agent else "process"] * 4, results
    assert "server listening on tcp://127.0.0.2:" in results[2][1], results[2][1]


@pytest.mark.parametrize("agent", [False, True], ids=["in process", "node agent"])
def test_pytorchjob_job(agent: bool) -> None:
    """A PyTorchJob of two pods running ``python train.py`` (no torchrun, no bpslaunch):
    bps.init() on each pod starts its server (bound to the address that routes to
    MASTER_ADDR), pod 0's also the scheduler; and, with ``BPS_NODE_AGENT=1``, its node
    agent, which runs the gradient pipeline."""
    port = free_port()
    jobs = [([PY, JOB], {**JOB_ENV, "RANK": str(pod), "WORLD_SIZE": "2",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "BPS_NODE_AGENT": str(int(agent))})
            for pod in range(2)]
    results = run_all(jobs, timeout=240)
    finished(results, 2)
    assert pipelines(results) == ["agent" if agent else "process"] * 2, results


def test_a_launch_error_under_torchrun_is_one_line_first(tmp_path) -> None:
    """torchrun on one node, without BPS_SECRET_FILE: the processes' first line is the
    error, and none of them adds a traceback (theirs, or gloo's from a node-local group
    whose peer left); torchrun's own report of the failed child comes after."""
    script = tmp_path / "train.py"
    script.write_text("import bps\nbps.init()\nprint('started', flush=True)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in CLUSTER_VARS and k not in ("BPS_SECRET_FILE", "BPS_INSECURE")}
    done = subprocess.run(TORCHRUN + ["--nproc-per-node", "2", "--master-port",
                                      str(free_port()), str(script)],
                          env={**env, **JOB_ENV, "OMP_NUM_THREADS": "1"},  # no banner
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    # torchrun's own lines: its log records (naming torch/distributed/) and the
    # ChildFailedError report at the end
    ours = [line for line in (done.stdout + done.stderr).splitlines()
            if line.strip() and "torch/distributed/" not in line]
    report = next((i for i, line in enumerate(ours) if line.startswith("Traceback")),
                  len(ours))
    assert "torch.distributed.elastic" in "\n".join(ours[report:]), ours  # torchrun's
    before = ours[:report]
    assert before and all(line == before[0] for line in before), before
    assert before[0].startswith("bps.init(): error: no cluster credentials: "
                                "BPS_SECRET_FILE is not set; make a key file with "
                                "`bpslaunch keygen PATH`"), before
    assert "started" not in done.stdout


MIXED_BACKEND_JOB = """
import datetime, sys
import torch, torch.distributed as dist
dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=60))
value = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(value)  # a CPU tensor: gloo, where the default group alone would be NCCL
assert value.tolist() == [3.0] * 4, value
dist.destroy_process_group()
sys.stdout.write("cluster-job ok %d\\n" % int(sys.argv[1]))
"""


@pytest.mark.cuda
def test_the_gpu_backend_string_serves_cpu_tensors() -> None:
    """docs/runtime.md's ``backend="cpu:gloo,cuda:nccl"`` on a GPU host: CPU tensors
    reduce over gloo next to NCCL (two ranks on one GPU: NCCL itself stays unused)."""
    port = free_port()
    jobs = [([PY, "-c", MIXED_BACKEND_JOB, str(rank)],
             {**JOB_ENV, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port)}) for rank in range(2)]
    finished(run_all(jobs, timeout=120), 2)


def test_a_failing_process_stops_every_launcher() -> None:
    """SLURM-style, one task per node: task 1 exits with 3 after bps.init(); every
    bpslaunch ends non-zero, task 0's (the scheduler's, server 0's and worker 0's
    output) with the error naming worker 1 and what it did, never worker 0, and none
    hangs."""
    script = ("import sys, bps\nbps.init()\n"
              "if bps.rank() == 1: sys.exit(3)\nbps.shutdown()\n")
    port = free_port()
    jobs = [(BPSLAUNCH + [PY, "-c", script],
             {**JOB_ENV, "SLURM_PROCID": str(task), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
              "SLURM_NODEID": str(task), "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
              "MASTER_PORT": str(port)}) for task in range(2)]
    results = run_all(jobs, timeout=180)
    assert results[1][0] != 0 and results[0][0] != 0, results
    named = "worker 1 at 127.0.0.2 failed: the process exited without calling bps.shutdown()"
    for role in ("scheduler", "server0", "worker0"):
        assert re.search(rf"\[{role}[^\]]*\].*{re.escape(named)}", results[0][1]), \
            (role, results[0][1])
    assert not re.search(r"worker 0 at \S+ (died|failed)", results[0][1]), results[0][1]
