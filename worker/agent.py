"""The node agent: a process that runs a worker node's :class:`WorkerEngine`.

With ``BPS_NODE_AGENT=1``, local rank 0 starts this process from ``bps.init()``
(:class:`bps.worker.agent_proxy.AgentProxy`); the engine's threads (I/O, codecs) then
run under the agent's own GIL instead of the training process's. The training process
keeps the model, autograd and the optimizer, and talks to the agent through a socket
pair: each key has an input and an output buffer in shared memory (:mod:`bps.common.shm`),
a push is announced in a few bytes, and its completion too (:mod:`bps.worker.agent_wire`).

Lifecycle: the agent connects to the scheduler (as the engine would in the training
process), says HELLO with the node's facts, then serves: pushes inline on the thread that
reads the socket, every other call (declare, barrier, rollback, state_dict,
load_state_dict, stats, close) in order on a thread of its own. It ends after
``close``; when the training process goes away without closing (its end of the socket
reaches EOF, or its pid is no longer the agent's parent) it reports the node FAILED to the
scheduler, naming the training process, and exits. It ignores Ctrl-C and SIGTERM, which
reach the training process's whole process group: the training process reports them
through the agent, then closes it. An error of its own goes to the
training process (FATAL) before it exits, so that fails naming the node and the error.

With several local ranks, the others connect to the agent too (an abstract Unix socket
named by job and node, :func:`bps.worker.agent_group.socket_name`), each served by an
:class:`Agent` of its own on the same engine; the node's collectives meet in a
:class:`bps.worker.agent_group.Hub`. One that ends without leaving fails the node.

Run by the proxy only::

    python -m bps.worker.agent FD PARENT_PID
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import traceback
from typing import Any

import torch

from bps.common import shm, trace
from bps.common.cpu_policy import use_batch_policy
from bps.common.env import ClusterEnv
from bps.compressors.warm import load_soon
from bps.worker import agent_wire as wire
from bps.worker.agent_group import Hub, socket_name
from bps.worker.send_queues import Skipped

log = logging.getLogger("bps")


class _Key:
    """A key's buffers in shared memory."""

    __slots__ = ("inp", "out", "compressed", "staged")

    def __init__(self, inp: torch.Tensor, out: torch.Tensor, compressed: bool,
                 staged: bool) -> None:
        self.inp, self.out, self.compressed, self.staged = inp, out, compressed, staged


class Agent:
    """Serves one training process over ``link`` with ``engine``."""

    def __init__(self, link: wire.Link, engine: Any, parent: int,
                 env: ClusterEnv | None = None, tracer: Any = None) -> None:
        self.link = link
        self.engine = engine
        self.parent = parent
        self.env, self.tracer = env, tracer
        self.local_rank = 0  # the local rank served (1, 2, ...: connected, not our parent)
        self.hub: Hub | None = None  # the node's collectives, with several local ranks
        self.failure: str | None = None  # why a local rank other than 0 gave up
        self.segments: list = []
        self.keys: dict[int, _Key] = {}
        self.calls: queue.Queue = queue.Queue()
        self.closed = threading.Event()
        self._ended = threading.Event()  # the I/O thread reads no more frames
        self._caller = threading.Thread(target=self._call_loop, name="bps-agent-calls",
                                        daemon=True)
        self._watch = threading.Thread(target=self._watch_parent, name="bps-agent-watch",
                                       daemon=True)

    # -- serving ---------------------------------------------------------------------

    def serve(self) -> str | None:
        """Serve until ``close`` (None) or until the training process is gone (why).

        The engine's I/O thread reads the frames and makes their pushes, in the same
        turn as it sends them and decodes the replies: the agent's Python then runs on
        one thread, which never waits for another to let go of the GIL. Once the engine
        stops (closed, failed), this thread reads the frames that remain."""
        self._caller.start()
        self._watch.start()
        if self._serve_on_io_thread():
            return None
        while True:
            try:
                message = self.link.recv()
            except OSError:  # reset: the training process was killed with frames unread
                message = None
            if message is None:
                break
            self._frame(*message)
            if self.closed.is_set():
                return None
        self.calls.put(None)
        if self.closed.wait(1.0):  # a close was read just before the end
            return None
        return f"its training process (pid {self.parent}) ended without closing bps"

    def _frame(self, kind: int, body: bytes) -> None:
        if kind == wire.PUSH:
            self._push(*wire.unpack_push(body))
        elif kind == wire.CALL:
            self.calls.put(wire.unpack_call(body))
        else:
            self.on_frame(kind, body)

    def _serve_on_io_thread(self) -> bool:
        """Have the engine's I/O thread read and serve the frames until ``close`` (True),
        the end of the stream, or the engine's end (False: :meth:`serve` reads on). An
        error serving a frame is raised here, as :meth:`serve` raises it."""
        fd = self.link.sock.fileno()
        error: list[BaseException] = []

        def readable() -> None:
            if self._ended.is_set():  # closed, or left: the stream is not ours to read
                self.engine.remove_reader(fd)
                return
            try:
                frames = self.link.recv_available()
            except OSError:  # reset: the training process was killed with frames unread
                frames = None
            try:
                for frame in frames or ():
                    self._frame(*frame)
                    self.engine.flush()  # this push leaves before the next is compressed
            except BaseException as exc:  # noqa: BLE001 - raised again by serve()
                error.append(exc)
                frames = None
            if frames is None:  # the end of the stream (read on by serve()), or an error
                self.engine.remove_reader(fd)
                self._ended.set()

        self.engine.add_reader(fd, readable)
        while not self._ended.wait(0.5):
            if not self.engine.io_running:  # closed or failed: the frames are read here
                break
        self._ended.set()  # the I/O thread, if it still runs, reads no more
        if error:
            raise error[0]
        return self.closed.is_set()

    def on_frame(self, kind: int, body: bytes) -> None:
        """A frame of another kind: a collective of the local ranks, or a subclass's
        (:mod:`bps.core.shared_pipeline`)."""
        if kind == wire.COLL and self.hub is not None:
            self.hub.arrive(self.local_rank, self, body)
            return
        raise ValueError(f"the node agent got a frame of unknown kind {kind}")

    def send(self, frame: bytes) -> None:
        """Send ``frame`` to the training process (nothing where it is gone)."""
        self._send(frame)

    def _push(self, key: int, step: int, lr: float, priority: int, scale: float,
              mark: str | None, what: str, generation: int | None) -> None:
        slot = self.keys.get(key)
        try:
            if slot is None:
                raise ValueError(f"key {key}: push_pull before declare")
            out = slot.out if slot.compressed or slot.staged else None
            future = self.engine.push_pull(key, None if mark else slot.inp, step, lr,
                                           priority=priority, out=out, mark=mark, what=what,
                                           momentum_scale=scale, generation=generation)
        except BaseException as exc:  # noqa: BLE001 - the caller's future gets it
            self._send_failure(key, exc)
            return
        future.add_done_callback(lambda done: self._done(key, slot, done))

    def _done(self, key: int, slot: _Key, future) -> None:
        try:
            result = future.result()
            if isinstance(result, Skipped):
                frame = wire.pack_done(key, wire.SKIPPED, pickle.dumps(result))
            else:
                if result.data_ptr() != slot.out.data_ptr():
                    slot.out.copy_(result.reshape(-1))
                frame = wire.pack_done(key, wire.OK)
        except BaseException as exc:  # noqa: BLE001 - the caller's future gets it
            self._send_failure(key, exc)
            return
        self._send(frame)

    def _send_failure(self, key: int, exc: BaseException) -> None:
        self._send(wire.pack_done(key, wire.FAILED, pickled_error(exc)))

    def _send(self, frame: bytes) -> None:
        try:
            self.link.send(frame)
        except OSError:  # the training process is gone: serve() sees the end
            pass

    # -- calls -----------------------------------------------------------------------

    def _call_loop(self) -> None:
        while True:
            item = self.calls.get()
            if item is None:
                return
            call_id, payload = item
            try:
                method, args, kwargs = pickle.loads(payload)
                result = getattr(self, f"call_{method}")(*args, **kwargs)
                frame = wire.pack_call(wire.REPLY, call_id, b"\1" + pickle.dumps(result))
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                frame = wire.pack_call(wire.REPLY, call_id, b"\0" + pickled_error(exc))
            self._send(frame)
            if method in ("close", "leave"):
                self.closed.set()
                self._ended.set()
                try:  # wakes serve(): the proxy closes its end once it has the reply
                    self.link.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return

    def call_map(self, path: str, size: int) -> None:
        self.segments.append(shm.map_segment(path, size))

    def view(self, where: tuple[int, int], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` x ``dtype`` at ``where`` (segment, offset) of the served process's."""
        return shm.tensor(self.segments[where[0]], where[1], numel, dtype)

    def call_declare(self, key: int, numel: int, dtype: torch.dtype, params: dict | None,
                     name: str, server: int | None, device: str | None,
                     inp: tuple[int, int], out: tuple[int, int]) -> None:
        self.engine.declare(key, numel, dtype, params, name=name, server=server,
                            device=None if device is None else torch.device(device))
        if device is None:  # the chains run here: so that the first push does not wait
            load_soon(params, dtype)  # for numba (as the trainer does in-process)
        self.keys[key] = _Key(self.view(inp, numel, dtype), self.view(out, numel, dtype),
                              params is not None, device is not None)

    def call_rollback(self, step: int, keys: list[int]) -> None:
        self.engine.rollback(step, keys)

    def call_barrier(self) -> None:
        self.engine.barrier()

    def call_state_dict(self) -> dict:
        return self.engine.state_dict()

    # a worker node joining a running job (bps.core.rejoin), and the nodes that send it
    def call_join(self) -> tuple[int, list[int], int]:
        return self.engine.join()

    def call_fetch_state(self, generation: int, source: int) -> tuple[int, bytes]:
        return self.engine.fetch_state(generation, source)

    def call_publish_state(self, generation: int, blob: bytes) -> None:
        self.engine.publish_state(generation, blob)

    def call_set_membership(self, generation: int, members: list[int]) -> None:
        self.engine.set_membership(generation, members)

    def call_membership(self) -> tuple[int, int]:
        """(barriers entered, the latest membership generation announced)."""
        return self.engine.barriers, self.engine.announced_generation

    def call_set_barriers(self, barriers: int) -> None:
        self.engine.barriers = barriers

    def call_load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def call_stats(self):
        return self.engine.stats

    def call_close(self, failure: str | None) -> None:
        self.engine.close(failure=failure)

    def call_leave(self, failure: str | None) -> None:
        """A local rank other than 0 leaves (``failure``: it gives up, and why)."""
        self.failure = failure

    # -- the parent ----------------------------------------------------------------

    def _watch_parent(self) -> None:
        """A training process killed outright may leave its end of the socket open in
        children it forked (data loader workers): its pid going away ends the agent."""
        while not self.closed.wait(0.5):
            if (os.getppid() != self.parent) if self.local_rank == 0 else \
                    not _alive(self.parent):
                log.error("bps node agent: the training process (pid %d) is gone",
                          self.parent)
                try:
                    self.link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _serve_local_ranks(env: ClusterEnv, engine: Any, agent_type: type[Agent], hub: Hub,
                       hello: bytes) -> None:
    """Take the connections of local ranks 1, 2, ... (:func:`agent_group.socket_name`),
    each served by an agent of its own on the same engine; one that ends without
    leaving, or gives up, fails the node and ends this process."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_name(env.root_port, env.worker_id))
    server.listen(env.local_size)
    while True:
        conn, _ = server.accept()
        link = wire.Link(conn)
        message = link.recv()
        if message is None or message[0] != wire.JOIN:
            link.close()
            continue
        who = pickle.loads(message[1])
        agent = agent_type(link, engine, who["pid"], env=env)
        agent.local_rank, agent.hub = who["local_rank"], hub
        link.send(hello)
        threading.Thread(target=_serve_local_rank, args=(agent,), daemon=True,
                         name=f"bps-agent-rank{agent.local_rank}").start()


def _serve_local_rank(agent: Agent) -> None:
    gone = agent.serve()
    why = agent.failure or gone
    if why is None:
        return
    text = (f"worker node {agent.engine.node_id}: local rank {agent.local_rank} (pid "
            f"{agent.parent}): {why}")
    log.error("bps node agent: %s", text)
    try:
        agent.engine.close(failure=text)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def pickled_error(exc: BaseException) -> bytes:
    """``exc`` pickled, where it also unpickles (its type, its message); else a
    RuntimeError with its type's name and message."""
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
        return blob
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


def main(argv: list[str], agent_type: type[Agent] = Agent) -> int:
    """The agent process (``agent_type``: a subclass that serves more)."""
    fd, parent = int(argv[0]), int(argv[1])
    # Ctrl-C and SIGTERM reach the training process's whole process group: the training
    # process reports them through the agent, then closes it (or the agent sees it gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    link = wire.Link(socket.socket(fileno=fd))
    engine = None
    try:
        from bps.worker.engine import WorkerEngine

        env = ClusterEnv.from_environ()
        use_batch_policy(env.sched_batch)
        label = f"worker{env.worker_id}.agent"
        tracer = trace.from_env(env, label)
        # the chains on the thread that pushes and on the I/O thread: in a process of
        # its own, codec threads would only hand every key from one thread to the next
        engine = WorkerEngine.connect(env, tracer=tracer, codec_threads=0)
        hello = wire.pack(wire.HELLO, pickle.dumps({
            "node_id": engine.node_id, "num_workers": engine.num_workers,
            "num_servers": engine.num_servers, "job_seed": engine.job_seed,
            "servers": engine.servers, "pid": os.getpid(), "joining": engine.joining}))
        agent = agent_type(link, engine, parent, env=env, tracer=tracer)
        if env.local_size > 1:  # the other local ranks connect; collectives in the agent
            agent.hub = Hub(env.local_size)
            threading.Thread(target=_serve_local_ranks, daemon=True, name="bps-agent-listen",
                             args=(env, engine, agent_type, agent.hub, hello)).start()
        link.send(hello)
        gone = agent.serve()
        if gone is not None:
            log.error("bps node agent of worker node %d: %s", engine.node_id, gone)
            engine.close(failure=f"worker node {engine.node_id}: {gone}")
            return 1
        if tracer is not None:
            tracer.save()
        return 0
    except BaseException as exc:  # noqa: BLE001 - told to the training process, then exit
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        log.error("bps node agent failed: %s", text)
        try:
            link.send(wire.pack(wire.FATAL, text.encode()))
        except OSError:
            pass
        if engine is not None:
            try:
                engine.close(failure=f"the node agent failed: {text}")
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
