"""``bpslaunch local``: a whole cluster on this machine, over loopback.

Usage::

    bpslaunch local --workers 2 --servers 1 [--local-size 2] -- python train.py --lr 0.1

Starts one scheduler, M servers and N worker nodes of L processes each, on free
loopback ports; every worker process also gets torch.distributed's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), so ``dist.init_process_group()`` works next to ``bps.init()``.
Every output line is prefixed with the role and rank (``[server0]``,
``[worker1.0]``: node 1, local rank 0). When any process fails all others are stopped
and bpslaunch exits with its code, unless ``--min-workers M`` (``BPS_MIN_WORKERS``) lets
worker nodes leave: then up to N - M worker nodes may fail and the job goes on without
them (docs/runtime.md, "Elastic membership"); ``--spare-servers S``
(``BPS_SPARE_SERVERS``) starts S spare servers more, idle until a server dies: one then
takes its keys and the job goes on (docs/runtime.md, "Server replacement");
``--max-restarts N`` starts a failed worker node (same command, environment and worker
id; it joins the job again) or server again, up to N times in all, and starts one spare
server unless ``--spare-servers`` says otherwise (it takes a dead server's slot at once;
the restarted server waits as the next spare); Ctrl-C tears everything down. Every process gets
a fresh cluster key (``BPS_SECRET_FILE``) in a private temporary directory, removed
when the job ends (none with ``BPS_INSECURE=1``). Where ``OMP_NUM_THREADS`` is unset,
the worker processes get the cores divided among the job's workers and servers
(``bps.launch.role.omp_threads``), and so do the servers' engine threads where
``BPS_SERVER_THREADS`` is unset. Extra variables
(``BPS_TIMEOUT``, ``BYTEPS_PARTITION_BYTES``, ...) are passed through from the
environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Sequence

from bps.common.auth import job_credentials
from bps.common.env import MAX_SPARE_SERVERS
from bps.launch.role import free_ports, local_rank_envs, share_cores
from bps.launch.supervisor import (
    JOINED_DIR_VARIABLE,
    Supervisor,
    add_max_restarts_option,
    add_min_workers_option,
    check_max_restarts,
    command_problem,
    min_workers,
)


def sibling_pids(role: str) -> list[int]:
    """The pids of the processes of ``role`` (``"server"``, ``"scheduler"``, ...) in this
    process's job: its siblings (``bpslaunch local`` starts every role) whose
    environment has ``DMLC_ROLE=role``; those that end meanwhile, or are not ours to read,
    are left out.

        >>> sibling_pids("server")  # not under bpslaunch local: none
        []
    """
    parent, tag, pids = os.getppid(), f"DMLC_ROLE={role}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if tag in environ.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, ValueError):  # ended meanwhile, or not ours to read
            continue
    return sorted(pids)


def parse_args(args: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bpslaunch local",
                                     description="Run a bps cluster on loopback.")
    parser.add_argument("--workers", type=int, default=1, help="worker nodes (default 1)")
    parser.add_argument("--servers", type=int, default=1, help="servers (default 1)")
    parser.add_argument("--local-size", type=int, default=1,
                        help="processes per worker node (default 1)")
    add_min_workers_option(parser)
    parser.add_argument("--spare-servers", type=int, default=None,
                        help="spare servers started besides --servers, idle until a server "
                        "dies: one then takes its keys and the job goes on (default: none, "
                        "a dead server ends the job; BPS_SPARE_SERVERS)")
    add_max_restarts_option(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...")
    ns = parser.parse_args(list(args))
    if ns.command and ns.command[0] == "--":
        ns.command = ns.command[1:]
    for flag in ("workers", "servers", "local_size"):
        if getattr(ns, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    ns.min_workers = min_workers(parser, ns.min_workers, ns.workers, "--workers")
    spare_flag = "--spare-servers"
    if ns.spare_servers is None and os.environ.get("BPS_SPARE_SERVERS", "").strip():
        raw = os.environ["BPS_SPARE_SERVERS"].strip()
        if not raw.isdigit():
            parser.error(f"BPS_SPARE_SERVERS={raw!r} is not an integer")
        ns.spare_servers, spare_flag = int(raw), "BPS_SPARE_SERVERS"
    if ns.spare_servers is not None and not 0 <= ns.spare_servers <= MAX_SPARE_SERVERS:
        parser.error(f"{spare_flag}={ns.spare_servers} out of range: expected 0 to "
                     f"{MAX_SPARE_SERVERS}")
    check_max_restarts(parser, ns.max_restarts, ns.min_workers, ns.workers, "--workers")
    if ns.max_restarts and ns.spare_servers is None:
        # a warm spare takes a dead server's slot in a fraction of a second; the dead
        # one, started again (seconds: python, torch), waits as the next spare
        ns.spare_servers = 1
    if not ns.command:
        parser.error("missing the command to run: bpslaunch local [options] -- CMD...")
    problem = command_problem(ns.command)
    if problem:
        parser.error(problem)
    return ns


def main(args: Sequence[str]) -> int:
    """Run the cluster; returns the exit code of the first failing process, else 0."""
    ns = parse_args(args)
    base = dict(os.environ)
    # every rendezvous at once: one at a time, two could be handed the same port
    scheduler_port, master_port, *node_ports = free_ports(2 + ns.workers)
    base.update(DMLC_NUM_WORKER=str(ns.workers), DMLC_NUM_SERVER=str(ns.servers),
                DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(scheduler_port),
                DMLC_NODE_HOST="127.0.0.1", PYTHONUNBUFFERED="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    role_cmd = [sys.executable, "-m", "bps.launch.cli"]
    spare = 0
    if ns.min_workers is not None:
        base["BPS_MIN_WORKERS"] = str(ns.min_workers)
        spare = ns.workers - ns.min_workers
    spares = ns.spare_servers or 0
    if ns.spare_servers is not None:
        base["BPS_SPARE_SERVERS"] = str(ns.spare_servers)
    with job_credentials(os.environ) as credentials, \
            Supervisor(spare_nodes=spare, max_restarts=ns.max_restarts,
                       replace_servers=ns.spare_servers is not None) as supervisor, \
            tempfile.TemporaryDirectory(prefix="bps-joined-") as joined_dir:
        base.update(credentials)
        base[JOINED_DIR_VARIABLE] = joined_dir  # bps.init() leaves a file there
        # the scheduler and the spares mostly sleep
        processes = ns.workers * ns.local_size + ns.servers
        threads, engines = share_cores(processes)
        supervisor.spawn(role_cmd, {**base, "DMLC_ROLE": "scheduler"}, "scheduler",
                         service=True)
        for server in range(ns.servers):
            supervisor.spawn(role_cmd, {**base, **engines, "DMLC_ROLE": "server",
                                        "BPS_SERVER_ID": str(server)},
                             f"server{server}", service=True, server=True)
        for index in range(spares):  # ids from DMLC_NUM_SERVER on: they wait for a slot
            supervisor.spawn(role_cmd, {**base, **engines, "DMLC_ROLE": "server",
                                        "BPS_SERVER_ID": str(ns.servers + index)},
                             f"spare{index}", service=True, server=True)
        for node in range(ns.workers):
            node_env = {**base, **threads, "DMLC_ROLE": "worker",
                        "DMLC_WORKER_ID": str(node)}
            envs = local_rank_envs(node_env, ns.local_size, node_ports[node])
            for rank, env in enumerate(envs):
                supervisor.spawn(ns.command, env, f"worker{node}.{rank}", node=str(node))
        try:
            return supervisor.wait(joined=lambda: bool(os.listdir(joined_dir)))
        except KeyboardInterrupt:
            print("[bpslaunch] interrupted; stopping all processes", file=sys.stderr)
            return 128 + signal.SIGINT
