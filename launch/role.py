"""``bpslaunch CMD...``: run the role that ``DMLC_ROLE`` names.

Usage::

    DMLC_ROLE=scheduler DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 \\
        DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 bpslaunch
    DMLC_ROLE=worker DMLC_WORKER_ID=0 BYTEPS_LOCAL_SIZE=2 ... bpslaunch python train.py

The scheduler and servers run in this process (CMD is ignored). A worker node starts
``BYTEPS_LOCAL_SIZE`` copies of CMD with ``BYTEPS_LOCAL_RANK`` set and a node-local
torch.distributed rendezvous in ``BPS_LOCAL_MASTER_ADDR`` / ``BPS_LOCAL_MASTER_PORT``.
Where ``OMP_NUM_THREADS`` is unset and a node runs several processes, each gets the
cores divided among them (:func:`omp_threads`). A missing or malformed variable is
reported by name with exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

from bps.common.auth import AuthError, load_key
from bps.common.env import ClusterEnv, EnvError, launch_style
from bps.common.striping import host_cores
from bps.launch.supervisor import Supervisor, command_problem
from bps.server.role import EXIT_BAD_ENV, end_process, serve, setup_process


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    return free_ports(1, host)[0]


# ZeroMQ's bind_to_random_port (the servers' extra endpoints) draws from here up
RANDOM_BIND_LOW = 49152
PICK_LOW = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it hands out (``bind(0)``, an outgoing connection's
    own end): Linux's ``ip_local_port_range``, else IANA's 49152-65535."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago on ``host``.

    They are drawn below the kernel's ephemeral range and below ZeroMQ's random binds,
    so that between this pick and the bind of the process they are for, no outgoing
    connection or random bind of another process on the host takes one (a port the
    kernel hands out could be handed out again meanwhile). The sockets stay bound until
    all are picked: ports picked one at a time may repeat. Where no such range is left
    (the ephemeral range starts low), the kernel picks.

        >>> len(set(free_ports(8)))
        8
    """
    high = min(ephemeral_ports()[0], RANDOM_BIND_LOW)
    draw = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        tries = 0
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            tries += 1
            port = draw.randrange(PICK_LOW, high) if high - PICK_LOW >= 1000 and \
                tries <= 50 * count else 0
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(sock.getsockname()[1])
        return ports


def local_rank_envs(base: Mapping[str, str], local_size: int,
                    master_port: int | None = None) -> list[dict[str, str]]:
    """The environments of the ``local_size`` processes of one worker node.

    Besides bps's variables each gets torch.distributed's job-wide ``RANK`` (node x
    ``local_size`` + local rank), ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK``; ``MASTER_ADDR`` / ``MASTER_PORT`` pass through from ``base`` (the
    launcher sets them). bps's own node-local group meets at a different port
    (``BPS_LOCAL_MASTER_PORT``: ``master_port``, else a free one) on its own store, so the
    two never meet.

        >>> envs = local_rank_envs({"DMLC_WORKER_ID": "1", "DMLC_NUM_WORKER": "2"}, 2)
        >>> [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"]) for e in envs]
        [('2', '4', '0'), ('3', '4', '1')]
    """
    master_port = str(master_port or free_port())
    node = int(base.get("DMLC_WORKER_ID", "0"))
    world = int(base.get("DMLC_NUM_WORKER", "1")) * local_size
    envs = []
    for rank in range(local_size):
        env = dict(base)
        env.update(BYTEPS_LOCAL_RANK=str(rank), BYTEPS_LOCAL_SIZE=str(local_size),
                   BPS_LOCAL_MASTER_ADDR="127.0.0.1", BPS_LOCAL_MASTER_PORT=master_port,
                   RANK=str(node * local_size + rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(local_size),
                   GROUP_RANK=str(node), PYTHONUNBUFFERED="1")
        envs.append(env)
    return envs


def omp_threads(environ: Mapping[str, str], cores: int, processes: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of the ``processes`` worker processes that share
    ``cores`` on this host, where the user set none: ``cores // processes``, at least 1
    (torchrun's answer to the same problem is 1). Unset, torch gives every process an
    OpenMP worker per core, which spin between ops on the cores the other processes and
    bps's threads need (``bpslaunch local --workers 2`` on 2 cores: a training step 3-4x
    slower, docs/benchmarks.md). Empty where the user set it or one process runs.

        >>> omp_threads({}, 16, 4), omp_threads({"OMP_NUM_THREADS": "8"}, 16, 4)
        ({'OMP_NUM_THREADS': '4'}, {})
        >>> omp_threads({}, 2, 3), omp_threads({}, 16, 1)
        ({'OMP_NUM_THREADS': '1'}, {})
    """
    return _core_share(environ, "OMP_NUM_THREADS", cores, processes)


def server_threads(environ: Mapping[str, str], cores: int, processes: int
                   ) -> dict[str, str]:
    """``BPS_SERVER_THREADS`` for each server of a job whose ``processes`` (workers and
    servers) share ``cores`` on this host, where the user set none: ``cores //
    processes``, at least 1, the share :func:`omp_threads` gives a worker. A server left
    to itself counts only the servers on its host; threads beyond its share would wait
    for cores the workers use, and a lone engine thread serves on the server's I/O
    thread, with no hand-off between threads (docs/runtime.md).

        >>> server_threads({}, 16, 4), server_threads({"BPS_SERVER_THREADS": "8"}, 16, 4)
        ({'BPS_SERVER_THREADS': '4'}, {})
    """
    return _core_share(environ, "BPS_SERVER_THREADS", cores, processes)


def _core_share(environ: Mapping[str, str], name: str, cores: int, processes: int
                ) -> dict[str, str]:
    """``{name: cores // processes}`` (at least 1), where ``environ`` has no ``name``
    and several processes share the cores."""
    if name in environ or processes <= 1:
        return {}
    return {name: str(max(1, cores // processes))}


def share_cores(processes: int, servers: bool = True
                ) -> tuple[dict[str, str], dict[str, str]]:
    """:func:`omp_threads` (for each worker process) and, where ``servers`` run among the
    ``processes``, :func:`server_threads` (for each server) for this launcher's
    environment and cores, each said in one line on stderr where it chose a value."""
    cores = host_cores()
    threads = omp_threads(os.environ, cores, processes)
    engines = server_threads(os.environ, cores, processes) if servers else {}
    sharing = f"({cores} cores, {processes} processes of the job on this host)"
    for chosen, whom in ((threads, "worker process"), (engines, "server")):
        for name, value in chosen.items():
            print(f"[bpslaunch] {name}={value} for each {whom} {sharing}; set {name} to "
                  "choose another", file=sys.stderr, flush=True)
    return threads, engines


def main(args: Sequence[str]) -> int:
    """Run the role of the environment; returns the exit code."""
    try:
        style = launch_style()
    except EnvError:
        style = "dmlc"
    if style in ("torchrun", "slurm"):
        from bps.launch.cluster import main as run_cluster
        return run_cluster(args)
    try:
        env = ClusterEnv.from_environ()
    except EnvError as exc:
        print(f"bpslaunch: error: {exc} (`bpslaunch --help` shows the three ways to run)",
              file=sys.stderr)
        return EXIT_BAD_ENV
    if not env.insecure:  # BPS_INSECURE=1 is announced by the role itself
        try:
            load_key(env)
        except AuthError as exc:
            print(f"bpslaunch: error: {exc}", file=sys.stderr)
            return EXIT_BAD_ENV
    setup_process()
    if env.role != "worker":
        end_process(serve(env))
    if not args:
        print("bpslaunch: error: DMLC_ROLE=worker needs a command to run", file=sys.stderr)
        return EXIT_BAD_ENV
    problem = command_problem(args)
    if problem:
        print(f"bpslaunch: error: {problem}", file=sys.stderr)
        return EXIT_BAD_ENV
    threads, _ = share_cores(env.local_size, servers=False)
    with Supervisor() as supervisor:
        for rank, child_env in enumerate(local_rank_envs({**os.environ, **threads},
                                                         env.local_size)):
            supervisor.spawn(args, child_env, f"worker{env.worker_id}.{rank}")
        try:
            return supervisor.wait()
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
