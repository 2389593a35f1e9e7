"""The cluster environment: the DMLC_* / BYTEPS_* variables of docs/runtime.md plus bps's own.

Usage::

    from bps.common.env import ClusterEnv
    env = ClusterEnv.from_environ()          # raises EnvError naming a bad variable
    env.role, env.num_workers, env.timeout

bps's own variables:

* ``BPS_TIMEOUT`` (seconds, default 60): every blocking wait (rendezvous, declare,
  push_pull, barrier) ends in an error after this long.
* ``BPS_HEARTBEAT_INTERVAL`` (seconds, default 1): how often every node tells the
  scheduler it is alive.
* ``BPS_HEARTBEAT_TIMEOUT`` (seconds, default ``min(BPS_TIMEOUT, 10 * interval)``): a node
  silent for this long is declared dead and every other process fails naming it.
* ``BPS_MIN_WORKERS`` (default unset: every worker node is needed): the job goes on
  while at least this many worker nodes are left, ``1 <= M <= DMLC_NUM_WORKER``; a worker
  node that dies leaves the membership instead of failing the job (docs/runtime.md,
  "Elastic membership"). Every role reads it; the scheduler decides.
* ``BPS_SPARE_SERVERS`` (default unset: a dead server ends the job): a dead server's
  keys move to a replacement, one of up to this many idle spare servers
  (``0``-``64``; ``0``: no spares, a server started again with the same environment takes
  the slot) (docs/runtime.md, "Server replacement"). Every role reads it.
* ``DMLC_NODE_HOST`` (default 127.0.0.1): the address this process binds and advertises.
* ``BPS_SERVER_ID`` (servers, optional): this server's rank; unset: registration order.
  With ``BPS_SPARE_SERVERS=S``, ``DMLC_NUM_SERVER`` to ``DMLC_NUM_SERVER + S - 1`` name
  spares.
* ``BPS_JOB_SEED`` (scheduler only, optional): the job seed; random if unset.
* ``BPS_SERVER_THREADS`` (servers, default: the cores this process may run on divided
  among the servers on its host, see ``bps.common.striping.engine_threads``): engine threads
  decoding, summing and re-encoding different keys.
* ``BPS_MAX_INFLIGHT`` (workers, default 64): pushes per server not yet acknowledged;
  further partitions wait in the priority queue.
* ``BPS_CONNECTIONS_PER_SERVER`` (workers, default: follows the host, see
  :mod:`bps.common.striping`): CURVE connections from each worker node to each server; a key
  always travels on the same one.
* ``BPS_IO_THREADS`` (servers and worker engines, default: follows the host): ZeroMQ I/O
  threads, each encrypting and decrypting the connections it owns.
* ``BPS_MALLOC_TUNE`` (servers and worker engines, default 1): ``0`` leaves glibc's
  allocator as it is (see :mod:`bps.common.memory`); read by :func:`malloc_tune`.
* ``BPS_LOCAL_MASTER_ADDR`` / ``BPS_LOCAL_MASTER_PORT``: the node-local torch.distributed
  rendezvous that ``bpslaunch`` sets for the processes of one worker node.
* ``BPS_SECRET_FILE``: the cluster's key file (``bpslaunch keygen PATH``); every
  connection is authenticated and encrypted with it (see :mod:`bps.common.auth`).
* ``BPS_INSECURE`` (default 0): ``1`` runs without credentials, in plain TCP (a warning
  at every role's start).
* ``BPS_NODE_AGENT`` (workers, default 0): ``1`` runs the worker engine in a node agent
  process that local rank 0 starts (:mod:`bps.worker.agent`), with the gradients in
  shared memory, so its threads do not share the training process's GIL.
* ``BPS_MAX_MESSAGE_BYTES`` (default ``2 * BYTEPS_PARTITION_BYTES + 65536``, at least
  1 MiB): the largest frame a server accepts; a key's raw size must fit in half of it.

Clusters' own launchers (see :func:`derive_worker_env`): where ``DMLC_ROLE`` is unset,
torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` (also Kubernetes' PyTorchJob) or SLURM's ``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST`` name a worker
process; ``BPS_SERVERS_PER_NODE`` (default 1) places the servers.

BytePS's ``BYTEPS_MIN_COMPRESS_BYTES`` (default 65536): tensors smaller than this travel
uncompressed; :func:`min_compress_bytes` reads it for ``compression_params`` without a
``min_compress_bytes`` key.

BytePS's timeline variables (workers and servers; see :mod:`bps.common.trace`):

* ``BPS_FRAME_BYTES`` (default 131072 with CURVE, 0 with ``BPS_INSECURE=1``): a payload
  larger than this travels as several frames of this size (the last one shorter), which
  libzmq's CURVE encrypts faster than one large frame (docs/benchmarks.md); 0 sends
  every payload as one frame. At least 4096 unless 0.
* ``BPS_SCHED_BATCH`` (default 1): node agents, and the servers of a job with node
  agents, run under Linux's ``SCHED_BATCH`` (:mod:`bps.common.cpu_policy`); ``0`` keeps
  the default policy.
* ``BYTEPS_TRACE_ON`` (default 0): ``1`` records each process's steps
  ``BYTEPS_TRACE_START_STEP`` (default 10) through ``BYTEPS_TRACE_END_STEP`` (default 20)
  into ``BYTEPS_TRACE_DIR`` (default ``./traces``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from bps.common.protocol import MIN_FRAME_BYTES
from bps.common.striping import MAX_SERVER_THREADS, is_loopback

ROLES = ("scheduler", "server", "worker")
DEFAULT_PARTITION_BYTES = 4096000
DEFAULT_MIN_COMPRESS_BYTES = 65536
DEFAULT_FRAME_BYTES = 131072  # with CURVE; without it every payload is one frame
MAX_SPARE_SERVERS = 64  # BPS_SPARE_SERVERS


class EnvError(ValueError):
    """A missing or malformed environment variable; the message names it."""


def _get(environ: Mapping[str, str], name: str, default: str | None) -> str:
    value = environ.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise EnvError(f"environment variable {name} is not set")
        return default
    return value.strip()


def _int(environ: Mapping[str, str], name: str, default: int | None, lo: int,
         hi: int | None = None) -> int:
    raw = _get(environ, name, None if default is None else str(default))
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None
    if value < lo or (hi is not None and value > hi):
        accepted = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise EnvError(f"{name}={value} out of range: expected an integer {accepted}")
    return value


def _optional_int(environ: Mapping[str, str], name: str, lo: int, hi: int) -> int | None:
    """``name`` as an integer in [lo, hi]; None where it is unset, empty or ``auto``."""
    if environ.get(name, "").strip().lower() in ("", "auto"):
        return None
    return _int(environ, name, None, lo, hi)


def _min_workers(environ: Mapping[str, str], num_workers: int) -> int | None:
    """``BPS_MIN_WORKERS`` in [1, DMLC_NUM_WORKER]; None where unset or empty.

        >>> _min_workers({"BPS_MIN_WORKERS": "3"}, 4), _min_workers({}, 4)
        (3, None)
    """
    if not environ.get("BPS_MIN_WORKERS", "").strip():
        return None
    value = _int(environ, "BPS_MIN_WORKERS", None, 1)
    if value > num_workers:
        raise EnvError(f"BPS_MIN_WORKERS={value} out of range: at most "
                       f"DMLC_NUM_WORKER={num_workers} (the worker nodes the job starts with)")
    return value


def _spare_servers(environ: Mapping[str, str]) -> int | None:
    """``BPS_SPARE_SERVERS`` in [0, 64]; None where unset or empty.

        >>> _spare_servers({"BPS_SPARE_SERVERS": "1"}), _spare_servers({})
        (1, None)
    """
    if not environ.get("BPS_SPARE_SERVERS", "").strip():
        return None
    return _int(environ, "BPS_SPARE_SERVERS", None, 0, MAX_SPARE_SERVERS)


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = _get(environ, name, repr(default))
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise EnvError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def dmlc_role(environ: Mapping[str, str] | None = None) -> str | None:
    """``DMLC_ROLE``, lower-cased; ``None`` when unset. Raises :class:`EnvError` for a
    value outside scheduler, server, worker.

        >>> dmlc_role({"DMLC_ROLE": "Server"}), dmlc_role({})
        ('server', None)
    """
    env = os.environ if environ is None else environ
    if not env.get("DMLC_ROLE", "").strip():
        return None
    value = _get(env, "DMLC_ROLE", None).lower()
    if value not in ROLES:
        raise EnvError(f"DMLC_ROLE={value!r}: expected one of {', '.join(ROLES)}")
    return value


def min_compress_bytes(environ: Mapping[str, str] | None = None) -> int:
    """``BYTEPS_MIN_COMPRESS_BYTES`` (default 65536); raises :class:`EnvError` naming it.

        >>> min_compress_bytes({"BYTEPS_MIN_COMPRESS_BYTES": "1024"})
        1024
    """
    env = os.environ if environ is None else environ
    return _int(env, "BYTEPS_MIN_COMPRESS_BYTES", DEFAULT_MIN_COMPRESS_BYTES, 0)


def malloc_tune(environ: Mapping[str, str] | None = None) -> bool:
    """``BPS_MALLOC_TUNE`` (0 or 1, default 1): whether to tune glibc's allocator.

        >>> malloc_tune({"BPS_MALLOC_TUNE": "0"})
        False
    """
    env = os.environ if environ is None else environ
    return bool(_int(env, "BPS_MALLOC_TUNE", 1, 0, 1))


@dataclass(frozen=True)
class ClusterEnv:
    """Everything a bps process learns from its environment."""

    role: str
    num_workers: int
    num_servers: int
    root_uri: str
    root_port: int
    worker_id: int | None = None
    server_id: int = -1
    local_rank: int = 0
    local_size: int = 1
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES
    timeout: float = 60.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    node_host: str = "127.0.0.1"
    job_seed: int | None = None
    server_threads: int | None = None  # None: follow the host's cores
    max_inflight: int = 64
    local_master_addr: str | None = None
    local_master_port: int | None = None
    trace_dir: str | None = None  # None: tracing off
    trace_first_step: int = 10
    trace_last_step: int = 20
    secret_file: str | None = None
    insecure: bool = False
    max_message_bytes: int = 2 * DEFAULT_PARTITION_BYTES + 65536
    frame_bytes: int = DEFAULT_FRAME_BYTES  # 0: every payload in one frame
    connections_per_server: int | None = None  # None: follows the host (bps.common.striping)
    io_threads: int | None = None  # None: follows the host (bps.common.striping)
    node_agent: bool = False  # local rank 0 runs the engine in a node agent process
    sched_batch: bool = True  # node agents and their job's servers under SCHED_BATCH
    min_workers: int | None = None  # BPS_MIN_WORKERS: worker nodes may leave down to this
    spare_servers: int | None = None  # BPS_SPARE_SERVERS: a dead server is replaced

    @property
    def elastic(self) -> bool:
        """Whether worker nodes may leave the job (``BPS_MIN_WORKERS`` is set)."""
        return self.min_workers is not None

    @property
    def replaces_servers(self) -> bool:
        """Whether a dead server's keys move to a replacement (``BPS_SPARE_SERVERS`` is
        set)."""
        return self.spare_servers is not None

    @property
    def on_one_host(self) -> bool:
        """Whether the whole job runs on this host (its scheduler is on loopback)."""

        return is_loopback(self.root_uri)

    @property
    def scheduler_address(self) -> str:
        """ZeroMQ endpoint of the scheduler."""
        return f"tcp://{self.root_uri}:{self.root_port}"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ClusterEnv:
        """Read and check the variables; raises :class:`EnvError` naming the bad one."""
        env = os.environ if environ is None else environ
        role = dmlc_role(env)
        if role is None:
            raise EnvError("environment variable DMLC_ROLE is not set")
        num_workers = _int(env, "DMLC_NUM_WORKER", None, 1)
        worker_id = None
        if role == "worker":
            worker_id = _int(env, "DMLC_WORKER_ID", None, 0, num_workers - 1)
        server_id = -1
        if role == "server" and env.get("BPS_SERVER_ID"):  # spares: num_servers and on
            server_id = _int(env, "BPS_SERVER_ID", None, 0,
                             _int(env, "DMLC_NUM_SERVER", None, 1)
                             + (_spare_servers(env) or 0) - 1)
        local_size = _int(env, "BYTEPS_LOCAL_SIZE", 1, 1)
        timeout = _seconds(env, "BPS_TIMEOUT", 60.0)
        interval = _seconds(env, "BPS_HEARTBEAT_INTERVAL", 1.0)
        hb_timeout = _seconds(env, "BPS_HEARTBEAT_TIMEOUT", min(timeout, 10 * interval))
        if hb_timeout <= interval:
            raise EnvError(f"BPS_HEARTBEAT_TIMEOUT={hb_timeout} must exceed "
                           f"BPS_HEARTBEAT_INTERVAL={interval}")
        seed = env.get("BPS_JOB_SEED")
        master_port = env.get("BPS_LOCAL_MASTER_PORT")
        trace_on = _int(env, "BYTEPS_TRACE_ON", 0, 0, 1)
        trace_first = _int(env, "BYTEPS_TRACE_START_STEP", 10, 0)
        trace_last = _int(env, "BYTEPS_TRACE_END_STEP", max(20, trace_first), 0)
        if trace_last < trace_first:
            raise EnvError(f"BYTEPS_TRACE_END_STEP={trace_last} is before "
                           f"BYTEPS_TRACE_START_STEP={trace_first}")
        partition_bytes = _int(env, "BYTEPS_PARTITION_BYTES", DEFAULT_PARTITION_BYTES, 16)
        secret_file = env.get("BPS_SECRET_FILE", "").strip()
        insecure = bool(_int(env, "BPS_INSECURE", 0, 0, 1))
        frame_bytes = _int(env, "BPS_FRAME_BYTES", 0 if insecure else DEFAULT_FRAME_BYTES, 0)
        if 0 < frame_bytes < MIN_FRAME_BYTES:
            raise EnvError(f"BPS_FRAME_BYTES={frame_bytes} must be 0 (one frame per payload) "
                           f"or at least {MIN_FRAME_BYTES}")
        return cls(
            role=role,
            num_workers=num_workers,
            num_servers=_int(env, "DMLC_NUM_SERVER", None, 1),
            root_uri=_get(env, "DMLC_PS_ROOT_URI", None),
            root_port=_int(env, "DMLC_PS_ROOT_PORT", None, 1, 65535),
            worker_id=worker_id,
            server_id=server_id,
            local_rank=_int(env, "BYTEPS_LOCAL_RANK", 0, 0, local_size - 1),
            local_size=local_size,
            partition_bytes=partition_bytes,
            min_compress_bytes=min_compress_bytes(env),
            timeout=timeout,
            heartbeat_interval=interval,
            heartbeat_timeout=hb_timeout,
            node_host=_get(env, "DMLC_NODE_HOST", "127.0.0.1"),
            job_seed=None if not seed else _int(env, "BPS_JOB_SEED", None, 1, 2**64 - 1),
            server_threads=_int(env, "BPS_SERVER_THREADS", None, 1, MAX_SERVER_THREADS)
            if _get(env, "BPS_SERVER_THREADS", "") else None,
            max_inflight=_int(env, "BPS_MAX_INFLIGHT", 64, 1),
            local_master_addr=env.get("BPS_LOCAL_MASTER_ADDR") or None,
            local_master_port=None if not master_port
            else _int(env, "BPS_LOCAL_MASTER_PORT", None, 1, 65535),
            trace_dir=os.path.abspath(_get(env, "BYTEPS_TRACE_DIR", "traces"))
            if trace_on else None,
            trace_first_step=trace_first,
            trace_last_step=trace_last,
            secret_file=os.path.abspath(os.path.expanduser(secret_file)) if secret_file
            else None,
            insecure=insecure,
            max_message_bytes=_int(env, "BPS_MAX_MESSAGE_BYTES",
                                   max(1 << 20, 2 * partition_bytes + 65536), 1 << 16),
            frame_bytes=frame_bytes,
            connections_per_server=_optional_int(env, "BPS_CONNECTIONS_PER_SERVER", 1, 64),
            io_threads=_optional_int(env, "BPS_IO_THREADS", 1, 64),
            node_agent=bool(_int(env, "BPS_NODE_AGENT", 0, 0, 1)),
            sched_batch=bool(_int(env, "BPS_SCHED_BATCH", 1, 0, 1)),
            min_workers=_min_workers(env, num_workers),
            spare_servers=_spare_servers(env),
        )


DEFAULT_MASTER_PORT = 29500  # torch.distributed's default


def parse_nodelist(value: str) -> list[str]:
    """Expand SLURM's compressed host list (``SLURM_JOB_NODELIST``) in order.

    Ranges keep their zero padding; a bracket may hold several ranges and single
    numbers; hosts are separated by commas outside brackets. Raises :class:`EnvError`
    naming the variable for a malformed list.

        >>> parse_nodelist("node[01-03,07]")
        ['node01', 'node02', 'node03', 'node07']
        >>> parse_nodelist("a1,b[2-3]")
        ['a1', 'b2', 'b3']
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(value):
        hosts.extend(_expand_host(item, value))
    if not hosts:
        raise EnvError(f"SLURM_JOB_NODELIST={value!r} names no host")
    return hosts


def _split_outside_brackets(value: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in value.strip():
        if char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise EnvError(f"SLURM_JOB_NODELIST={value!r}: unbalanced brackets")
        current += char
    if depth:
        raise EnvError(f"SLURM_JOB_NODELIST={value!r}: unbalanced brackets")
    return items + [current]


def _expand_host(item: str, whole: str) -> list[str]:
    bad = EnvError(f"SLURM_JOB_NODELIST={whole!r}: cannot read {item!r} "
                   "(expected host, host[1-3,7] or host[01-03]suffix)")
    if not item or item.startswith("["):
        raise bad
    if "[" not in item:
        if "]" in item:
            raise bad
        return [item]
    prefix, rest = item.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    tails = _expand_host(suffix, whole) if suffix else [""]
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise bad
        high = high or low
        if int(high) < int(low):
            raise bad
        names += [f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    return [name + tail for name in names for tail in tails]


def launch_style(environ: Mapping[str, str] | None = None) -> str | None:
    """Which launcher's variables describe this process: ``"dmlc"`` (``DMLC_ROLE``),
    ``"torchrun"`` (``RANK`` and ``WORLD_SIZE``; also PyTorchJob), ``"slurm"``
    (``SLURM_PROCID``) or ``None``, in that order of precedence.

        >>> launch_style({"RANK": "0", "WORLD_SIZE": "2"}), launch_style({})
        ('torchrun', None)
    """
    env = os.environ if environ is None else environ
    if env.get("DMLC_ROLE", "").strip():
        return "dmlc"
    if env.get("RANK", "").strip() and env.get("WORLD_SIZE", "").strip():
        return "torchrun"
    if env.get("SLURM_PROCID", "").strip():
        return "slurm"
    return None


def derive_worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables bps and torch.distributed need, derived from torchrun's or SLURM's.

    Every process the cluster launches is a worker process: its node is a bps worker
    node (``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``; ``SLURM_NODEID``), its
    local rank ``LOCAL_RANK`` / ``SLURM_LOCALID``. Each node runs
    ``BPS_SERVERS_PER_NODE`` servers (default 1); node 0 runs the scheduler at
    ``MASTER_ADDR:MASTER_PORT+1`` (``MASTER_ADDR`` under SLURM: the first host of
    ``SLURM_JOB_NODELIST``; ``MASTER_PORT`` default 29500). A node's local ranks meet
    at ``127.0.0.1:MASTER_PORT+2+node``; under SLURM a node's servers bind the address of
its host in ``SLURM_JOB_NODELIST`` (``DMLC_NODE_HOST``). Variables already set win; returns ``{}``
    where ``DMLC_ROLE`` is set or no cluster variables are. Raises :class:`EnvError`
    naming a bad variable.

        >>> env = derive_worker_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
        ...     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
        >>> env["DMLC_WORKER_ID"], env["BYTEPS_LOCAL_RANK"], env["DMLC_PS_ROOT_PORT"]
        ('1', '1', '29501')
    """
    env = os.environ if environ is None else environ
    style = launch_style(env)
    if style == "torchrun":
        world = _int(env, "WORLD_SIZE", None, 1)
        rank = _int(env, "RANK", None, 0, world - 1)
        local_size = _int(env, "LOCAL_WORLD_SIZE", 1, 1, world)
        if world % local_size:
            raise EnvError(f"WORLD_SIZE={world} is not a multiple of "
                           f"LOCAL_WORLD_SIZE={local_size}")
        local_rank = _int(env, "LOCAL_RANK", rank % local_size, 0, local_size - 1)
        nodes = world // local_size
        node = _int(env, "GROUP_RANK", rank // local_size, 0, nodes - 1)
        master = _get(env, "MASTER_ADDR", None)
        node_host = ""  # the launcher resolves this host's name
    elif style == "slurm":
        world = _int(env, "SLURM_NTASKS", None, 1)
        rank = _int(env, "SLURM_PROCID", None, 0, world - 1)
        hosts = parse_nodelist(_get(env, "SLURM_JOB_NODELIST", None))
        if world % len(hosts):
            raise EnvError(f"SLURM_NTASKS={world} is not a multiple of the "
                           f"{len(hosts)} hosts of SLURM_JOB_NODELIST (bps needs the same "
                           "number of tasks on every node)")
        local_size = world // len(hosts)
        nodes = len(hosts)
        node = _int(env, "SLURM_NODEID", None, 0, nodes - 1)
        local_rank = _int(env, "SLURM_LOCALID", None, 0, local_size - 1)
        master = _get(env, "MASTER_ADDR", hosts[0])
        node_host = hosts[node]  # the servers' address, resolved by the launcher
    else:
        return {}
    port = _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535 - 2 - nodes)
    per_node = _int(env, "BPS_SERVERS_PER_NODE", 1, 1, 64)
    derived = {
        "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(node), "DMLC_NUM_WORKER": str(nodes),
        "DMLC_NUM_SERVER": str(nodes * per_node), "DMLC_PS_ROOT_URI": master,
        "DMLC_PS_ROOT_PORT": str(port + 1), "BYTEPS_LOCAL_RANK": str(local_rank),
        "BYTEPS_LOCAL_SIZE": str(local_size), "BPS_SERVERS_PER_NODE": str(per_node),
        "BPS_LOCAL_MASTER_ADDR": "127.0.0.1", "BPS_LOCAL_MASTER_PORT": str(port + 2 + node),
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node),
        "MASTER_ADDR": master, "MASTER_PORT": str(port),
    }
    if node_host:
        derived["DMLC_NODE_HOST"] = node_host
    return {name: env.get(name, "").strip() or value for name, value in derived.items()}
