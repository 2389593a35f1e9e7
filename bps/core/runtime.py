"""Process-wide state of a bps worker process: what ``bps.init()`` sets up.

One :class:`Runtime` per process: the cluster environment, the node-local group of
local ranks and, on local rank 0 only, the push/pull engine that talks to the servers.

A process that ends without ``bps.shutdown()`` because it failed (an uncaught exception,
Ctrl-C, SIGTERM, ``sys.exit`` with a non-zero status) reports FAILED to the scheduler with
the reason, so every other process stops at once with an error naming this node, instead
of waiting for a step that will never come. One that ends normally (the end of the
script, ``sys.exit(0)``) has finished: it logs a warning and leaves as ``bps.shutdown()``
would, so the job succeeds.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
from typing import NoReturn

from bps.common import trace
from bps.common.auth import load_key
from bps.common.env import ClusterEnv, EnvError, derive_worker_env, launch_style
from bps.launch.supervisor import mark_joined
from bps.server.role import EXIT_BAD_ENV, end_process
from bps.worker.intranode import LocalGroup

log = logging.getLogger("bps")

LAUNCH_HINT = (
    "bps.init() reads the environment that bpslaunch sets; run the script as "
    "`bpslaunch local --workers N --servers M -- python script.py` "
    "(or set the DMLC_* variables of a ps-lite launch yourself)"
)


class Runtime:
    """The cluster this worker process belongs to."""

    def __init__(self, env: ClusterEnv) -> None:
        self.env = env
        self.local_rank = env.local_rank
        self.local_size = env.local_size
        self.node_id = env.worker_id
        self.rank = env.worker_id * env.local_size + env.local_rank
        label = f"worker{env.worker_id}" + (f".{env.local_rank}" if env.local_size > 1 else "")
        self.tracer = trace.from_env(env, label)
        self.engine = None
        self.agent_link = None  # local ranks 1, 2, ...: their connection to the node agent
        if env.node_agent and env.local_size > 1:
            # BPS_NODE_AGENT=1: the node's collectives go through its agent, not gloo
            from bps.worker.agent_group import AgentGroup
            from bps.worker.agent_proxy import AgentProxy

            if env.local_rank == 0:
                self.engine = carrier = AgentProxy.start(env, "bps.core.pipeline_agent")
            else:
                self.agent_link = carrier = AgentProxy.join_node(env)
            self.group = AgentGroup(carrier, env.local_rank, env.local_size, env.timeout)
        else:
            self.group = LocalGroup.connect(
                env.local_rank, env.local_size, env.local_master_addr or "127.0.0.1",
                env.local_master_port or 0, timeout_s=env.timeout,
            )
        self.setup_channel = self.group.channel("setup")
        if env.local_rank == 0:
            from bps.worker.agent_proxy import AgentProxy
            from bps.worker.engine import WorkerEngine

            # BPS_NODE_AGENT=1: the engine runs in a node agent process of its own
            if self.engine is None:
                self.engine = AgentProxy.start(env, "bps.core.pipeline_agent") \
                    if env.node_agent else WorkerEngine.connect(env, tracer=self.tracer)
            facts = struct.pack("<QQQ", self.engine.num_workers, self.engine.job_seed,
                                int(getattr(self.engine, "joining", False)))
        else:
            facts = None
        self.num_nodes, self.job_seed, joining = struct.unpack(
            "<QQQ", self.setup_channel.broadcast_bytes(facts)
        )
        # a node started after the job began (BPS_MIN_WORKERS): it joins once its trainer
        # is ready (bps.core.rejoin), with the state of a node present
        self.joining = bool(joining)
        if self.num_nodes != env.num_workers:
            raise EnvError(
                f"the scheduler reports {self.num_nodes} worker nodes but "
                f"DMLC_NUM_WORKER={env.num_workers}"
            )
        self.size = self.num_nodes * self.local_size  # the ranks present: gradients' divisor
        self.generation = 0  # the membership's (BPS_MIN_WORKERS: worker nodes may leave)
        self.members = list(range(self.num_nodes))  # the worker node ids present
        self._next_key = 0
        self._names = 0
        self._lock = threading.Lock()

    def set_membership(self, generation: int, members: list[int]) -> None:
        """Worker nodes left: from membership ``generation`` on, the worker nodes
        ``members`` are present, and gradients are divided by their ranks (``size``). An
        older generation changes nothing."""
        if generation > self.generation:
            self.generation = generation
            self.members = sorted(members)
            self.size = len(self.members) * self.local_size

    def next_key(self) -> int:
        """The key the next :meth:`allocate_keys` returns."""
        with self._lock:
            return self._next_key

    def skip_keys_to(self, key: int) -> None:
        """Allocate from ``key`` on (a joining node takes the key numbers the nodes
        present gave its trainer's keys); never backwards."""
        with self._lock:
            self._next_key = max(self._next_key, key)

    def allocate_keys(self, count: int) -> int:
        """First of ``count`` fresh keys; every process allocates in the same order."""
        with self._lock:
            first = self._next_key
            self._next_key += count
            return first

    def unique_name(self, prefix: str) -> str:
        """``prefix`` plus a counter: the same sequence of names in every process."""
        with self._lock:
            self._names += 1
            return f"{prefix}{self._names}"

    def close(self, barrier: bool = True, failure: str | None = None) -> None:
        """Leave the cluster; ``failure``: this process gives up, and why (no barrier)."""
        if barrier and failure is None:
            self.setup_channel.barrier()
        if self.engine is not None:
            if barrier and failure is None:
                self.engine.barrier()
            self.engine.close(failure=failure)
            self.engine = None
        if self.agent_link is not None:
            self.agent_link.close(failure=failure)
            self.agent_link = None
        self.group.close(destroy=failure is None)
        if self.tracer is not None:
            self.tracer.save()


_runtime: Runtime | None = None
_exit_reason: str | None = None  # why the process is ending, where known
_exit_status: object = None  # the argument of the sys.exit() that ends the process


def init() -> Runtime:
    """Join the cluster described by the environment (idempotent)."""
    global _runtime
    if _runtime is not None:
        return _runtime
    try:
        _from_cluster_launcher()
        env = ClusterEnv.from_environ()
    except EnvError as exc:
        if _under_cluster_launcher():
            _launch_error(exc)
        raise EnvError(f"{exc}. {LAUNCH_HINT}") from None
    if env.role != "worker":
        raise EnvError(f"bps.init() runs in worker processes, but DMLC_ROLE={env.role!r}")
    if env.local_size > 1 and (env.local_master_addr is None or env.local_master_port is None):
        raise EnvError(
            f"BYTEPS_LOCAL_SIZE={env.local_size} needs BPS_LOCAL_MASTER_ADDR and "
            f"BPS_LOCAL_MASTER_PORT (the node-local rendezvous). {LAUNCH_HINT}"
        )
    _bind_no_default_group()
    _runtime = Runtime(env)
    mark_joined(_runtime.rank)
    atexit.register(_close_at_exit)
    _watch_exits()
    return _runtime


def _bind_no_default_group() -> None:
    """Import ``torch.distributed.nn.functional`` before the script's own
    ``dist.init_process_group()``. Its functions take the default group as a default
    argument, bound at import, which the first optimizer triggers: bound to a live group,
    that keeps the group alive after ``destroy_process_group()``, to be torn down with
    the interpreter, where gloo now and then aborts the finished process ("terminate
    called without an active exception", exit code 134). Imported first, it binds None."""
    import torch.distributed.nn.functional  # noqa: F401


_services: subprocess.Popen | None = None  # scheduler/servers this process started


def _from_cluster_launcher() -> None:
    """Under torchrun or SLURM without ``bpslaunch``: take the derived DMLC_* variables
    (see :func:`bps.common.env.derive_worker_env`) and, on local rank 0, start this node's
    servers (node 0: also the scheduler) as ``bpslaunch`` would."""
    global _services
    derived = derive_worker_env()
    if not derived:
        return
    cluster_env = dict(os.environ)
    env = ClusterEnv.from_environ({**cluster_env, **derived})
    if not env.insecure:
        load_key(env)  # checked before anything starts: else the services fail first
    os.environ.update(derived)
    if derived["BYTEPS_LOCAL_RANK"] == "0" and not os.environ.get("BPS_LAUNCHED"):
        _services = subprocess.Popen([sys.executable, "-m", "bps.launch.cli"],
                                     env={**cluster_env, "BPS_LAUNCHED": "1"})
        os.environ["BPS_LAUNCHED"] = "1"
        atexit.register(_wait_services)


def _under_cluster_launcher() -> bool:
    """Whether torchrun's or SLURM's variables (not ``bpslaunch``) launched this process."""
    try:
        return launch_style() in ("torchrun", "slurm") and not os.environ.get("BPS_LAUNCHED")
    except EnvError:
        return False


def _launch_error(exc: EnvError) -> NoReturn:
    """A launch error under torchrun or SLURM: one line on stderr, before anything else
    (every process says it: the first to exit gets the others stopped), then exit 2
    before anything starts: no services, no node-local group whose peers would fail
    with tracebacks of their own."""
    print(f"bps.init(): error: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_ENV)


def _wait_services() -> None:
    """At exit: the services end by themselves once every worker left; wait for them."""
    if _services is None:
        return
    try:
        _services.wait(timeout=_timeout())
    except subprocess.TimeoutExpired:
        _services.terminate()
        _services.wait(timeout=10)


def _timeout() -> float:
    try:
        return ClusterEnv.from_environ().timeout
    except EnvError:
        return 60.0


def get() -> Runtime:
    """The runtime of this process; raises if ``bps.init()`` has not been called."""
    if _runtime is None:
        raise RuntimeError("bps.init() has not been called in this process")
    return _runtime


def shutdown() -> None:
    """Leave the cluster: wait for the other workers, then close connections."""
    global _runtime
    if _runtime is not None:
        runtime, _runtime = _runtime, None
        runtime.close(barrier=True)


def _close_at_exit() -> None:
    """At exit without ``bps.shutdown()``: a failing process reports FAILED; one that
    ends normally has finished and leaves as ``shutdown()`` would (with a warning)."""
    global _runtime
    if _runtime is None:
        return
    runtime, _runtime = _runtime, None
    reason = _exit_reason
    if reason is None and _exit_status not in (None, 0):
        reason = (f"the process exited without calling bps.shutdown() "
                  f"(sys.exit({_exit_status!r}))")
    if reason is not None:
        try:
            runtime.close(barrier=False, failure=reason)
        except Exception as exc:  # noqa: BLE001 - best effort at interpreter exit
            log.debug("closing bps at exit: %s", exc)
        if runtime.local_size > 1:
            # the node's gloo group, left undestroyed (its peers may be gone), would abort
            # the interpreter's teardown ("terminate called without an active exception")
            _exit_now(_failure_code())
        return
    if runtime.rank == 0:
        log.warning("bps: the script ended without bps.shutdown(); leaving the cluster "
                    "as it would (call it after training to wait for the other workers)")
    try:
        runtime.close(barrier=True)
    except Exception as exc:  # noqa: BLE001 - the job failed after all: say so, exit 1
        log.error("bps: leaving the cluster at exit failed: %s", exc)
        _exit_now(1)


def _failure_code() -> int:
    """The exit status the interpreter would give the failure being reported."""
    if _exit_reason == "terminated by SIGTERM":
        return 128 + signal.SIGTERM
    if _exit_reason is not None:
        return 128 + signal.SIGINT if _exit_reason.startswith("KeyboardInterrupt") else 1
    return _exit_status if isinstance(_exit_status, int) else 1


def _exit_now(code: int) -> None:
    """End the process with ``code`` once the services and the output are settled."""
    _wait_services()
    end_process(code)


_exit_wrapper = None  # the sys.exit that remembers its status, once installed

def _watch_exits() -> None:
    """Remember why the process ends: an uncaught exception (Ctrl-C included) through
    ``sys.excepthook``; SIGTERM, where nobody handles it, becomes ``SystemExit(143)``
    so that the exit report still goes out."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:  # noqa: ANN001 - sys.excepthook's signature
        global _exit_reason
        _exit_reason = f"{kind.__name__}: {value}" if str(value) else kind.__name__
        _leaving()
        previous(kind, value, traceback)

    sys.excepthook = hook
    global _exit_wrapper
    if sys.exit is not _exit_wrapper:
        real_exit = sys.exit

        def exit_and_remember(status: object = None) -> None:
            global _exit_status
            _exit_status = status
            real_exit(status)

        _exit_wrapper = sys.exit = exit_and_remember
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    global _exit_reason
    _exit_reason = "terminated by SIGTERM"
    _leaving()
    raise SystemExit(128 + signal.SIGTERM)


def _leaving() -> None:
    """The process is on its way out with a failure: from now on a SIGTERM (bpslaunch
    stopping every process once the failure is known) must not interrupt the report or
    the exit callbacks with a second traceback. The exit stays bounded: bpslaunch sends
    SIGKILL after its grace period."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
