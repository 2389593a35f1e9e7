"""The cluster environment: the DMLC_* / BYTEPS_* variables of docs/runtime.md plus bps's own.

Usage::

    from bps.env import ClusterEnv
    env = ClusterEnv.from_environ()          # raises EnvError naming a bad variable
    env.role, env.num_workers, env.timeout

bps's own variables:

* ``BPS_TIMEOUT`` (seconds, default 60): every blocking wait (rendezvous, declare,
  push_pull, barrier) ends in an error after this long.
* ``BPS_HEARTBEAT_INTERVAL`` (seconds, default 1): how often every node tells the
  scheduler it is alive.
* ``BPS_HEARTBEAT_TIMEOUT`` (seconds, default ``min(BPS_TIMEOUT, 10 * interval)``): a node
  silent for this long is declared dead and every other process fails naming it.
* ``DMLC_NODE_HOST`` (default 127.0.0.1): the address this process binds and advertises.
* ``BPS_SERVER_ID`` (servers, optional): this server's rank; unset: registration order.
* ``BPS_JOB_SEED`` (scheduler only, optional): the job seed; random if unset.
* ``BPS_SERVER_THREADS`` (servers, default 4): engine threads summing different keys.
* ``BPS_MAX_INFLIGHT`` (workers, default 16): pushes per server not yet acknowledged;
  further partitions wait in the priority queue.
* ``BPS_MALLOC_TUNE`` (servers and worker engines, default 1): ``0`` leaves glibc's
  allocator as it is (see :mod:`bps.memory`); read by :func:`malloc_tune`.
* ``BPS_LOCAL_MASTER_ADDR`` / ``BPS_LOCAL_MASTER_PORT``: the node-local torch.distributed
  rendezvous that ``bpslaunch`` sets for the processes of one worker node.
* ``BPS_SECRET_FILE``: the cluster's key file (``bpslaunch keygen PATH``); every
  connection is authenticated and encrypted with it (see :mod:`bps.auth`).
* ``BPS_INSECURE`` (default 0): ``1`` runs without credentials, in plain TCP (a warning
  at every role's start).
* ``BPS_MAX_MESSAGE_BYTES`` (default ``2 * BYTEPS_PARTITION_BYTES + 65536``, at least
  1 MiB): the largest frame a server accepts; a key's raw size must fit in half of it.

BytePS's ``BYTEPS_MIN_COMPRESS_BYTES`` (default 65536): tensors smaller than this travel
uncompressed; :func:`min_compress_bytes` reads it for ``compression_params`` without a
``min_compress_bytes`` key.

BytePS's timeline variables (workers and servers; see :mod:`bps.trace`):

* ``BYTEPS_TRACE_ON`` (default 0): ``1`` records each process's steps
  ``BYTEPS_TRACE_START_STEP`` (default 10) through ``BYTEPS_TRACE_END_STEP`` (default 20)
  into ``BYTEPS_TRACE_DIR`` (default ``./traces``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

ROLES = ("scheduler", "server", "worker")
DEFAULT_PARTITION_BYTES = 4096000
DEFAULT_MIN_COMPRESS_BYTES = 65536


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
    server_threads: int = 4
    max_inflight: int = 16
    local_master_addr: str | None = None
    local_master_port: int | None = None
    trace_dir: str | None = None  # None: tracing off
    trace_first_step: int = 10
    trace_last_step: int = 20
    secret_file: str | None = None
    insecure: bool = False
    max_message_bytes: int = 2 * DEFAULT_PARTITION_BYTES + 65536

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
        if role == "server" and env.get("BPS_SERVER_ID"):
            server_id = _int(env, "BPS_SERVER_ID", None, 0,
                             _int(env, "DMLC_NUM_SERVER", None, 1) - 1)
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
            server_threads=_int(env, "BPS_SERVER_THREADS", 4, 1, 64),
            max_inflight=_int(env, "BPS_MAX_INFLIGHT", 16, 1),
            local_master_addr=env.get("BPS_LOCAL_MASTER_ADDR") or None,
            local_master_port=None if not master_port
            else _int(env, "BPS_LOCAL_MASTER_PORT", None, 1, 65535),
            trace_dir=os.path.abspath(_get(env, "BYTEPS_TRACE_DIR", "traces"))
            if trace_on else None,
            trace_first_step=trace_first,
            trace_last_step=trace_last,
            secret_file=os.path.abspath(os.path.expanduser(secret_file)) if secret_file
            else None,
            insecure=bool(_int(env, "BPS_INSECURE", 0, 0, 1)),
            max_message_bytes=_int(env, "BPS_MAX_MESSAGE_BYTES",
                                   max(1 << 20, 2 * partition_bytes + 65536), 1 << 16),
        )
