"""``bpslaunch netem``: a whole bps cluster on emulated hosts behind a slow network.

One network namespace per worker node, per server and for the scheduler, all on
one bridge, every link shaped in both directions with tc (tbf for the rate,
netem for delay and loss; see :mod:`bps.launch.netns`). Each process runs in its
host's namespace (``ip netns exec``) and talks to the others over the hosts'
addresses (10.77.0.0/24, private to these namespaces).

Usage::

    bpslaunch netem --nodes 4 --servers 4 --rate 100mbit -- python examples/mnist.py ...
    bpslaunch netem --nodes 4 --rate 100mbit --torchrun -- python examples/ddp_mnist.py ...

``--min-workers M`` lets worker hosts leave the job as ``bpslaunch local``'s does
(docs/runtime.md, "Elastic membership"), and ``--max-restarts N`` starts a failed
worker host's process (it joins the job again) or server again, up to N times in all
(no spare hosts: a restarted server takes its own slot back). ``--torchrun`` runs CMD
with torchrun's variables (MASTER_ADDR = node 0, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE) and no bps servers: for DDP baselines on the same emulated network.
``--stats-json PATH`` writes the bytes every host sent and received. Everything is torn
down on exit, on failure, on Ctrl-C and on SIGTERM; namespaces left by a run that was
killed outright are removed by the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from bps.common.auth import job_credentials
from bps.launch.link_shape import LinkShape, NetnsError
from bps.launch.netns import EmulatedCluster, clean_stale, require_privileges
from bps.launch.role import share_cores
from bps.launch.supervisor import (
    Supervisor,
    add_max_restarts_option,
    add_min_workers_option,
    check_max_restarts,
    command_problem,
    min_workers,
)

SCHEDULER_PORT = 9000  # every namespace is fresh, so fixed ports cannot clash
TORCH_MASTER_PORT = 29500
LOCAL_MASTER_PORT = 29600


def _log(message: str) -> None:
    print(f"[netem] {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bpslaunch netem",
        description="Run a bps cluster on emulated hosts (network namespaces + tc).",
        epilog="Example: bpslaunch netem --nodes 4 --servers 4 --rate 100mbit -- "
               "python examples/mnist.py --compressor onebit --ef vanilla")
    parser.add_argument("--nodes", type=int, required=True, help="worker nodes (hosts)")
    parser.add_argument("--servers", type=int, default=None,
                        help="parameter servers, one host each (default: --nodes; "
                             "must be 0 or absent with --torchrun)")
    parser.add_argument("--rate", required=True,
                        help="bandwidth of every link direction, e.g. 100mbit, 20mbit, 1gbit; "
                             "'none' for no limit")
    parser.add_argument("--delay", default="0ms",
                        help="delay of every link direction, e.g. 1ms (host to host crosses "
                             "two links); needs the kernel's netem qdisc")
    parser.add_argument("--loss", default="0%",
                        help="packet loss of every link direction, e.g. 0.1%%; needs netem")
    parser.add_argument("--local-size", type=int, default=1,
                        help="processes per worker node (BYTEPS_LOCAL_SIZE)")
    parser.add_argument("--torchrun", action="store_true",
                        help="run CMD with torch.distributed variables instead of bps roles")
    parser.add_argument("--stats-json", metavar="PATH",
                        help="write the bytes each host sent and received to PATH")
    add_min_workers_option(parser)
    add_max_restarts_option(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: bpslaunch netem [OPTIONS] -- CMD...")
    problem = command_problem(command)
    if problem:
        parser.error(problem)
    args.command = command
    if args.nodes < 1:
        parser.error(f"--nodes must be >= 1, got {args.nodes}")
    if args.local_size < 1:
        parser.error(f"--local-size must be >= 1, got {args.local_size}")
    if args.servers is None:
        args.servers = 0 if args.torchrun else args.nodes
    if args.torchrun and args.servers:
        parser.error("--torchrun runs no bps servers: leave --servers out (or set it to 0)")
    if not args.torchrun and args.servers < 1:
        parser.error(f"--servers must be >= 1, got {args.servers}")
    if args.torchrun and args.min_workers is not None:
        parser.error("--torchrun runs no bps scheduler: --min-workers needs bps mode")
    if args.torchrun and args.max_restarts:
        parser.error("--torchrun runs no bps scheduler: --max-restarts needs bps mode")
    args.min_workers = None if args.torchrun else \
        min_workers(parser, args.min_workers, args.nodes, "--nodes")
    check_max_restarts(parser, args.max_restarts, args.min_workers, args.nodes, "--nodes")
    try:
        args.shape = LinkShape.parse(args.rate, args.delay, args.loss)
    except NetnsError as exc:
        parser.error(str(exc))
    return args


def host_names(nodes: int, servers: int, torchrun: bool) -> list[str]:
    """Hosts in address order: the scheduler first (bps mode), servers, then worker nodes."""
    names = [] if torchrun else ["sched"]
    return names + [f"s{j}" for j in range(servers)] + [f"w{i}" for i in range(nodes)]


def _base_env(ifname: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME=ifname, PYTHONUNBUFFERED="1")
    env.setdefault("TP_SOCKET_IFNAME", ifname)
    return env


def bps_processes(args: argparse.Namespace, cluster: EmulatedCluster):
    """(name, argv, env, role) of the scheduler, servers and worker nodes for bps mode."""
    sched = cluster.hosts["sched"]
    common = {
        "DMLC_NUM_WORKER": str(args.nodes),
        "DMLC_NUM_SERVER": str(args.servers),
        "DMLC_PS_ROOT_URI": sched.ip,
        "DMLC_PS_ROOT_PORT": str(SCHEDULER_PORT),
        "BYTEPS_LOCAL_SIZE": str(args.local_size),
        # torch.distributed's rendezvous for the job's own process group (see role.py)
        "MASTER_ADDR": cluster.hosts["w0"].ip,
        "MASTER_PORT": str(TORCH_MASTER_PORT),
    }
    if args.min_workers is not None:
        common["BPS_MIN_WORKERS"] = str(args.min_workers)
    if args.max_restarts:  # no spare hosts: a restarted server takes its own slot back
        common["BPS_SPARE_SERVERS"] = os.environ.get("BPS_SPARE_SERVERS", "0")
    launcher = [sys.executable, "-m", "bps.launch.cli"]
    roles = [("sched", "scheduler", {})]
    roles += [(f"s{j}", "server", {"BPS_SERVER_ID": str(j)}) for j in range(args.servers)]
    roles += [(f"w{i}", "worker", {"DMLC_WORKER_ID": str(i)}) for i in range(args.nodes)]
    for name, role, extra in roles:
        host = cluster.hosts[name]
        env = _base_env(host.ifname)
        env.update(common)
        env.update(extra, DMLC_ROLE=role, DMLC_NODE_HOST=host.ip)
        yield name, host.exec_argv(launcher + list(args.command)), env, role


def torchrun_processes(args: argparse.Namespace, cluster: EmulatedCluster):
    """(name, argv, env, role) of every process of every node, torchrun's variables."""
    master = cluster.hosts["w0"]
    world = args.nodes * args.local_size
    for i in range(args.nodes):
        host = cluster.hosts[f"w{i}"]
        for local_rank in range(args.local_size):
            env = _base_env(host.ifname)
            env.update(MASTER_ADDR=master.ip, MASTER_PORT=str(TORCH_MASTER_PORT),
                       WORLD_SIZE=str(world), RANK=str(i * args.local_size + local_rank),
                       LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(args.local_size),
                       GROUP_RANK=str(i), NODE_RANK=str(i))
            name = f"w{i}" if args.local_size == 1 else f"w{i}.{local_rank}"
            yield name, host.exec_argv(list(args.command)), env, "worker"


def write_stats(path: str, args: argparse.Namespace, cluster: EmulatedCluster,
                wall_seconds: float, exit_code: int) -> None:
    counters = cluster.counters()
    stats = {
        "rate_bits": args.shape.rate_bits,
        "delay_us": args.shape.delay_us,
        "loss_percent": args.shape.loss_percent,
        "nodes": args.nodes,
        "servers": args.servers,
        "local_size": args.local_size,
        "mode": "torchrun" if args.torchrun else "bps",
        "wall_seconds": wall_seconds,
        "exit_code": exit_code,
        "hosts": {name: {"ip": cluster.hosts[name].ip, **counters[name]} for name in counters},
    }
    with open(path, "w") as handle:
        json.dump(stats, handle, indent=2)


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


def main(argv: list[str]) -> int:
    """Entry point of ``bpslaunch netem``; returns the exit code."""
    args = parse_args(argv)
    try:
        require_privileges()
        clean_stale(log=_log)
    except NetnsError as exc:
        print(f"bpslaunch netem: error: {exc}", file=sys.stderr)
        return 2
    previous = {sig: signal.signal(sig, _raise_terminated)
                for sig in (signal.SIGTERM, signal.SIGHUP)}
    cluster = None
    exit_code = 1
    try:
        cluster = EmulatedCluster(host_names(args.nodes, args.servers, args.torchrun),
                                  args.shape, log=_log)
        cluster.build()
        for host in cluster.hosts.values():
            _log(f"host {host.name:>5}: {host.ip} (namespace {host.netns})")
        processes = torchrun_processes if args.torchrun else bps_processes
        # the emulated hosts share this machine's cores
        sharing = args.nodes * args.local_size + (0 if args.torchrun else args.servers)
        threads, engines = share_cores(sharing, servers=not args.torchrun)
        shares = {"worker": threads, "server": engines}
        start = time.monotonic()
        with job_credentials(os.environ) as credentials:
            spare = 0 if args.min_workers is None else args.nodes - args.min_workers
            exit_code = run_processes([
                (name, argv, {**env, **credentials, **shares.get(role, {})},
                 role) for name, argv, env, role in processes(args, cluster)],
                spare_nodes=spare, max_restarts=args.max_restarts)
        if args.stats_json:
            write_stats(args.stats_json, args, cluster, time.monotonic() - start, exit_code)
    except NetnsError as exc:
        print(f"bpslaunch netem: error: {exc}", file=sys.stderr)
        exit_code = 2
    except KeyboardInterrupt:
        _log("interrupted: stopping every process and removing the emulated network")
        exit_code = 130
    except _Terminated as exc:
        _log(f"{exc}: stopping every process and removing the emulated network")
        exit_code = 128 + exc.signum
    finally:
        try:
            if cluster is not None:
                cluster.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return exit_code


def run_processes(processes: list[tuple[str, list[str], dict, str]],
                  spare_nodes: int = 0, max_restarts: int = 0) -> int:
    """Start every process (name, argv, env, role) under one supervisor; the workers'
    exit codes decide.

    Scheduler and servers are services: once every worker exited 0 they get the
    supervisor's grace period to finish on their own. ``spare_nodes`` worker hosts may
    fail with the job going on (``--min-workers``); ``max_restarts`` failed worker hosts
    and servers are started again (``--max-restarts``).
    """
    with Supervisor(spare_nodes=spare_nodes, max_restarts=max_restarts,
                    replace_servers=bool(max_restarts)) as supervisor:
        for name, argv, env, role in processes:
            service = role != "worker"
            supervisor.spawn(argv, env, name, service=service,
                             node=None if service else name, server=role == "server")
        return supervisor.wait()
