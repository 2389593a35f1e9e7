"""``bpslaunch CMD...`` under torchrun, SLURM or a Kubernetes PyTorchJob.

Usage::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST0:29500 \\
        --no-python bpslaunch python train.py                # every process of torchrun
    srun --ntasks-per-node 2 bpslaunch python train.py      # every SLURM task

Where ``DMLC_ROLE`` is unset and torchrun's or SLURM's variables are, every launched
process is a worker process (:func:`bps.common.env.derive_worker_env` maps the variables).
Local rank 0 of each node also starts that node's ``BPS_SERVERS_PER_NODE`` servers
(default 1), and node 0's local rank 0 the scheduler at ``MASTER_ADDR:MASTER_PORT+1``
(it binds every interface at that port).
CMD gets bps's variables and torch.distributed's (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so both
``bps.init()`` and ``dist.init_process_group()`` work in it. Without CMD only the
services run (what ``bps.init()`` starts when no ``bpslaunch`` started them).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

from bps.common.auth import AuthError, load_key
from bps.common.env import ClusterEnv, EnvError, derive_worker_env
from bps.launch.supervisor import Supervisor

EXIT_BAD_ENV = 2
ROLE_CMD = [sys.executable, "-m", "bps.launch.cli"]


def node_address(environ: Mapping[str, str]) -> str:
    """Where this node's servers bind: the IPv4 address of ``DMLC_NODE_HOST`` (an address
    or a host name; under SLURM this node's entry of ``SLURM_JOB_NODELIST``), else the
    address of the interface that routes to the scheduler (``DMLC_PS_ROOT_URI``). A host
    name that resolves to loopback (Debian's ``127.0.1.1``) while the scheduler is not
    on loopback is ignored in favour of the route.

        >>> node_address({"DMLC_NODE_HOST": "127.0.0.2", "DMLC_PS_ROOT_URI": "127.0.0.1"})
        '127.0.0.2'
    """
    root = socket.gethostbyname(environ["DMLC_PS_ROOT_URI"])
    host = environ.get("DMLC_NODE_HOST", "").strip()
    if host:
        address = socket.gethostbyname(host)
        if not address.startswith("127.") or root.startswith("127."):
            return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((root, 9))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def service_envs(worker_env: Mapping[str, str]) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of the services a worker process starts: none unless it is
    local rank 0; its node's servers; on node 0 first the scheduler.

        >>> env = derive_worker_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR":
        ...                          "127.0.0.1", "DMLC_NODE_HOST": "127.0.0.1"})
        >>> [name for name, _ in service_envs({**env, "DMLC_NODE_HOST": "127.0.0.1"})]
        ['scheduler', 'server0']
    """
    if worker_env["BYTEPS_LOCAL_RANK"] != "0":
        return []
    node = int(worker_env["DMLC_WORKER_ID"])
    per_node = int(worker_env["BPS_SERVERS_PER_NODE"])
    host = node_address(worker_env)
    services = []
    if node == 0:
        # every interface: MASTER_ADDR may be a name, or "localhost" on node 0 itself
        services.append(("scheduler", {**worker_env, "DMLC_ROLE": "scheduler",
                                       "DMLC_PS_ROOT_URI": "0.0.0.0"}))
    for j in range(node * per_node, (node + 1) * per_node):
        services.append((f"server{j}", {**worker_env, "DMLC_ROLE": "server",
                                        "BPS_SERVER_ID": str(j), "DMLC_NODE_HOST": host}))
    return services


def main(args: Sequence[str]) -> int:
    """Run this process's part of the job; returns the exit code."""
    try:
        derived = derive_worker_env()
        env = ClusterEnv.from_environ({**os.environ, **derived})
        if not env.insecure:
            load_key(env)
        base = {**os.environ, **derived, "BPS_LAUNCHED": "1", "PYTHONUNBUFFERED": "1"}
        services = service_envs(base)
    except (EnvError, AuthError, OSError) as exc:
        print(f"bpslaunch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ENV
    if not args and not services:
        print("bpslaunch: error: no command to run, and this process (local rank "
              f"{env.local_rank}) starts no servers", file=sys.stderr)
        return EXIT_BAD_ENV
    label = f"worker{env.worker_id}.{env.local_rank}"
    with Supervisor() as supervisor:
        for name, service_env in services:
            supervisor.spawn(ROLE_CMD, service_env, name, service=bool(args))
        if args:
            supervisor.spawn(list(args), base, label)
        try:
            return supervisor.wait()
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
