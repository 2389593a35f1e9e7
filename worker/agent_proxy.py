"""The training process's side of the node agent (``BPS_NODE_AGENT=1``).

:class:`AgentProxy` has the interface of :class:`bps.worker.engine.WorkerEngine` that the
front ends use (declare, push_pull returning a future, rollback, barrier, state_dict,
load_state_dict, stats, close) and forwards it to the node agent process
(:mod:`bps.worker.agent`), which runs the engine under its own GIL. Each declared key
gets an input and an output buffer in shared memory (:mod:`bps.common.shm`); a push
copies its tensor into the input and announces it in a few bytes; one reader thread
takes each completion, copies the aggregate out of the output buffer (into ``out``, or a
new tensor) and resolves the future.

Usage (what ``bps.init()`` does on local rank 0)::

    engine = AgentProxy.start(ClusterEnv.from_environ())   # the agent rendezvouses
    engine.declare(0, 1000, torch.float32, None, name="fc.bias")
    averaged = engine.push_pull(0, grad, step=0, lr=0.1).result()
    engine.close()

Failures: an agent that dies fails every pending and later call with a
:class:`bps.common.protocol.ClusterError` naming the worker node, the agent's pid, how it
ended and its last error; the agent ends by itself when the training process is gone.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from bps.common import shm
from bps.common.env import ClusterEnv
from bps.common.protocol import MARKS, STATE_CHUNK, ClusterError
from bps.worker import agent_wire as wire
from bps.worker.engine import STATE_WINDOW, EngineStats

log = logging.getLogger("bps")

__all__ = ["AgentProxy"]

START_SLACK_S = 30.0  # beyond BPS_TIMEOUT: the agent imports torch before the rendezvous


class _Key:
    """A declared key: its buffers in shared memory and the push in flight."""

    __slots__ = ("key", "name", "numel", "dtype", "inp", "out", "compressed", "staged",
                 "future", "target")

    def __init__(self, key: int, name: str, numel: int, dtype: torch.dtype,
                 inp: torch.Tensor, out: torch.Tensor, compressed: bool, staged: bool) -> None:
        self.key, self.name, self.numel, self.dtype = key, name, numel, dtype
        self.inp, self.out, self.compressed, self.staged = inp, out, compressed, staged
        self.future: concurrent.futures.Future | None = None
        self.target: torch.Tensor | None = None

    def label(self) -> str:
        return f"key {self.key} ({self.name!r})" if self.name else f"key {self.key}"


class AgentProxy:
    """A worker node's engine in its node agent process; create it with :meth:`start`."""

    def __init__(self, env: ClusterEnv, process: subprocess.Popen | None,
                 link: wire.Link) -> None:
        self.env = env
        self.process = process  # None: a local rank other than 0, connected to the agent
        self.pid = process.pid if process is not None else None
        self._link = link
        self._keys: dict[int, _Key] = {}
        self._lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._error: ClusterError | None = None
        self._last_error = ""
        self._closing = False
        self._pipes: dict[int, Any] = {}  # pipelines the agent runs, by number
        self._pipe_ids = itertools.count()
        self._collectives: Any = None  # the node's AgentGroup (several local ranks)
        job = f"{env.root_port}"
        self._arena = shm.Arena(job, lambda path, size: self._call("map", path, size))
        hello = self._hello()
        self.node_id: int = hello["node_id"]
        self.num_workers: int = hello["num_workers"]
        self.num_servers: int = hello["num_servers"]
        self.job_seed: int = hello["job_seed"]
        self.servers: list[str] = hello["servers"]
        self.joining: bool = bool(hello.get("joining", False))  # not supported in an agent
        self.pid = hello["pid"]
        self._reader = threading.Thread(target=self._read_loop, name="bps-agent-reader",
                                        daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, env: ClusterEnv, module: str = "bps.worker.agent") -> AgentProxy:
        """Start this node's agent process (``python -m module``), which rendezvouses
        with the scheduler; returns once it is connected (up to ``BPS_TIMEOUT`` plus its
        start-up)."""
        shm.remove_stale()
        shm.check_room(shm.MIN_SEGMENT)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", module, str(theirs.fileno()),
                 str(os.getpid())], pass_fds=(theirs.fileno(),))
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.settimeout(env.timeout + START_SLACK_S)
        try:
            return cls(env, process, wire.Link(mine))
        except BaseException:
            process.kill()
            process.wait()
            mine.close()
            raise

    @classmethod
    def join_node(cls, env: ClusterEnv) -> AgentProxy:
        """Connect local rank 1, 2, ... to the node agent that local rank 0 starts
        (retrying up to ``BPS_TIMEOUT`` plus its start-up); its engine is not for this
        process: the connection carries the node's collectives (:mod:`agent_group`)."""
        from bps.worker.agent_group import socket_name

        limit = env.timeout + START_SLACK_S
        deadline = time.monotonic() + limit
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(socket_name(env.root_port, env.worker_id))
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"local rank {env.local_rank} of worker node {env.worker_id}: no node "
                        f"agent to connect to within {limit:g} s (local rank 0 starts it): "
                        f"{exc}") from None
                time.sleep(0.05)
        link = wire.Link(sock)
        link.send(wire.pack(wire.JOIN, pickle.dumps({"local_rank": env.local_rank,
                                                     "pid": os.getpid()})))
        sock.settimeout(limit)
        try:
            return cls(env, None, link)
        except BaseException:
            link.close()
            raise

    def watch_collectives(self, group: Any) -> None:
        """Hand COLL_DONE frames to ``group.collective_done(body)``, the agent's end to
        ``group.agent_died(error)``."""
        self._collectives = group

    def _hello(self) -> dict:
        try:
            message = self._link.recv()
        except TimeoutError:
            raise ClusterError(f"the node agent of worker node {self.env.worker_id} (pid "
                               f"{self.pid}) did not connect within "
                               f"{self.env.timeout + START_SLACK_S:g} s") from None
        self._link.sock.settimeout(None)
        if message is not None and message[0] == wire.FATAL:
            raise ClusterError(f"the node agent of worker node {self.env.worker_id} (pid "
                               f"{self.pid}) failed to start: {message[1].decode()}")
        if message is None or message[0] != wire.HELLO:
            raise ClusterError(f"the node agent of worker node {self.env.worker_id} (pid "
                               f"{self.pid}) {self._how_ended()} before it connected")
        return pickle.loads(message[1])

    # ------------------------------------------------------------------ engine interface

    @property
    def stats(self) -> EngineStats:
        """The agent's engine's counters (:class:`bps.worker.engine.EngineStats`)."""
        return self._call("stats")

    def declare(self, key: int, numel: int, dtype: torch.dtype, params: dict | None,
                name: str = "", server: int | None = None,
                device: torch.device | None = None) -> None:
        """:meth:`bps.worker.engine.WorkerEngine.declare`, with the key's buffers."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"key {key} ({name!r}) is on {device}: BPS_NODE_AGENT=1 "
                             f"averages CPU tensors only; unset it for GPU training")
        if key in self._keys:
            raise ValueError(f"key {key} ({name!r}) declared twice")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"key {key} ({name!r}): numel={numel!r} must be an int >= 0")
        nbytes = numel * dtype.itemsize
        inp, out = self._arena.alloc(nbytes), self._arena.alloc(nbytes)
        self._call("declare", key, numel, dtype, params, name, server,
                   None if device is None else str(device), inp, out)
        self._keys[key] = _Key(key, name, numel, dtype, self._arena.tensor(*inp, numel, dtype),
                               self._arena.tensor(*out, numel, dtype), params is not None,
                               device is not None)

    def push_pull(self, key: int, tensor: torch.Tensor | None, step: int, lr: float,
                  priority: int = 0, out: torch.Tensor | None = None,
                  mark: str | None = None, what: str = "",
                  momentum_scale: float = 1.0, ready: Any = None,
                  generation: int | None = None) -> concurrent.futures.Future:
        """:meth:`bps.worker.engine.WorkerEngine.push_pull`: ``tensor`` is copied into the
        key's input buffer before this returns, so the caller may reuse it at once."""
        slot = self._keys.get(key)
        if slot is None:
            raise ValueError(f"key {key}: push_pull before declare")
        if mark is not None and mark not in MARKS:
            raise ValueError(f"{slot.label()}: mark={mark!r}, expected one of {MARKS}")
        if mark is None:
            flat = tensor.reshape(-1)
            if flat.numel() != slot.numel or flat.dtype != slot.dtype:
                raise ValueError(f"{slot.label()}: tensor has numel={flat.numel()} dtype="
                                 f"{flat.dtype}, declared numel={slot.numel} "
                                 f"dtype={slot.dtype}")
        if out is not None and (out.numel() != slot.numel or not out.is_contiguous()
                                or out.device.type != "cpu"
                                or (not slot.staged and (not slot.compressed
                                                         or out.dtype != slot.dtype))):
            raise ValueError(f"{slot.label()}: out must be a contiguous CPU tensor of "
                             f"numel={slot.numel} dtype={slot.dtype}, for a compressed key")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{slot.label()}: step={step!r} must be an int >= 0")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # either the agent's death is known here, or _died fails it
            if self._error is not None:
                raise self._error
            if slot.future is not None:
                raise RuntimeError(f"{slot.label()}: a push_pull is already in flight")
            slot.future, slot.target = future, None if out is None else out.reshape(-1)
        if mark is None:
            slot.inp.copy_(flat)
        self._send(wire.pack_push(key, step, float(lr), int(priority), float(momentum_scale),
                                  mark, what, generation))
        return future

    def rollback(self, step: int, keys: list[int]) -> None:
        self._call("rollback", step, keys)

    def barrier(self) -> None:
        self._call("barrier")

    def state_dict(self) -> dict:
        return self._call("state_dict", waits=self._state_waits())

    # joining a running job: the engine's calls, answered by the agent's engine
    def join(self) -> tuple[int, list[int], int]:
        return self._call("join")

    def fetch_state(self, generation: int, source: int) -> tuple[int, bytes]:
        # the agent's engine waits up to BPS_TIMEOUT for each chunk and names what is
        # late; this bound only guards against an agent that stops answering
        return self._call("fetch_state", generation, source, waits=64)

    def publish_state(self, generation: int, blob: bytes) -> None:
        self._call("publish_state", generation, blob,
                   waits=max(1, -(-len(blob) // STATE_CHUNK)))

    def set_membership(self, generation: int, members: list[int]) -> None:
        self._call("set_membership", generation, list(members))

    @property
    def barriers(self) -> int:
        return self._call("membership")[0]

    @barriers.setter
    def barriers(self, value: int) -> None:
        self._call("set_barriers", int(value))

    @property
    def announced_generation(self) -> int:
        return self._call("membership")[1]

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state, waits=self._state_waits() + 1)  # + a barrier

    def _state_waits(self) -> int:
        """How many waits of up to ``BPS_TIMEOUT`` the agent's engine may take in a row
        for the chain states (one per window of requests)."""
        compressed = sum(slot.compressed for slot in self._keys.values()) + \
            sum(len(pipe.compressed_keys()) for pipe in list(self._pipes.values()))
        return max(1, -(-compressed // STATE_WINDOW))

    def close(self, failure: str | None = None) -> None:
        """Close the engine in the agent (``failure``: report the node FAILED, and why),
        then wait for the agent to end."""
        if self._closing:
            return
        self._closing = True
        if self.process is None:  # a local rank other than 0 leaves; the agent stays
            self._leave(failure)
            return
        try:
            if self._error is None:  # a failure is reported within 2 s, or not at all
                self._call("close", failure, limit=None if failure is None else 10.0)
        finally:
            try:  # the agent ends at the end of its stream
                self._link.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("bps: the node agent (pid %d) did not end; killing it", self.pid)
                self.process.kill()
                self.process.wait()
            self._link.close()
            self._reader.join(timeout=5)

    def _leave(self, failure: str | None) -> None:
        try:
            if self._error is None:
                self._call("leave", failure, limit=10.0)
        except ClusterError:  # local rank 0 closed the agent first: nothing to leave
            pass
        finally:
            try:
                self._link.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._reader.join(timeout=5)
            self._link.close()

    # ------------------------------------------------------------ pipelines in the agent

    def shared(self, nbytes: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """``nbytes`` zeroed bytes of shared memory the agent maps too: a uint8 tensor
        over them and where they lie (segment, offset), for the agent's side."""
        where = self._arena.alloc(nbytes)
        return self._arena.tensor(*where, nbytes, torch.uint8), where

    def call(self, method: str, *args: Any, waits: int = 1) -> Any:
        """``call_<method>(*args)`` of the agent's class, on its thread of calls."""
        return self._call(method, *args, waits=waits)

    def send(self, frame: bytes) -> None:
        """Send a frame of :mod:`bps.worker.agent_wire` to the agent."""
        self._send(frame)

    def attach(self, listener: Any) -> int:
        """A number for a pipeline the agent runs; its frames (GRAD_DONE, STEP_DONE,
        PIPE_ERROR) go to ``listener.agent_frame(kind, index, extra)`` on the reader
        thread, the agent's end to ``listener.agent_died(error)``;
        ``listener.compressed_keys()``: its compressed keys (a checkpoint waits for each)."""
        with self._lock:
            pipe_id = next(self._pipe_ids)
            self._pipes[pipe_id] = listener
        return pipe_id

    def detach(self, pipe_id: int) -> None:
        with self._lock:
            self._pipes.pop(pipe_id, None)

    # ------------------------------------------------------------------ the agent's side

    def _send(self, frame: bytes) -> None:
        try:
            self._link.send(frame)
        except OSError:
            self._died()
            raise self._error from None

    def _call(self, method: str, *args: Any, waits: int = 1, limit: float | None = None
              ) -> Any:
        """``method`` of the agent with ``args``; ``waits``: how many of the engine's
        waits (each up to ``BPS_TIMEOUT``) it may take; ``limit``: seconds instead."""
        call_id = next(self._call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # either the agent's death is known here, or _died fails it
            if self._error is not None:
                raise self._error
            self._calls[call_id] = future
        self._send(wire.pack_call(wire.CALL, call_id, pickle.dumps((method, args, {}))))
        wait = limit or waits * (self.env.timeout + 2 * self.env.heartbeat_interval) + 5
        try:
            return future.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise ClusterError(f"{method} in the node agent of worker node {self.node_id} "
                               f"(pid {self.pid}): no answer within {wait:g} s") from None

    def _read_loop(self) -> None:
        try:
            while self._read_one():
                pass
        except OSError:  # the socket broke (reset by a killed agent): the agent is gone
            pass
        self._died()

    def _read_one(self) -> bool:
        message = self._link.recv()
        if message is None:
            return False
        kind, body = message
        if kind == wire.DONE:
            self._complete(*wire.unpack_done(body))
        elif kind == wire.REPLY:
            call_id, payload = wire.unpack_call(body)
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is not None:
                if payload[:1] == b"\1":
                    future.set_result(pickle.loads(payload[1:]))
                else:
                    future.set_exception(pickle.loads(payload[1:]))
        elif kind == wire.FATAL:
            self._last_error = body.decode()
        elif kind == wire.COLL_DONE and self._collectives is not None:
            self._collectives.collective_done(body)
        elif kind in (wire.GRAD_DONE, wire.STEP_DONE, wire.PIPE_ERROR):
            pipe_id, index, extra = wire.unpack_pipe(body)
            listener = self._pipes.get(pipe_id)
            if listener is not None:
                listener.agent_frame(kind, index, extra)
        return True

    def _complete(self, key: int, status: int, extra: bytes) -> None:
        slot = self._keys.get(key)
        future = None if slot is None else slot.future
        if future is None:  # the agent's word on a key with no push of ours in flight
            self._last_error = f"the node agent reported key {key}, which has no push in flight"
            raise OSError(self._last_error)  # ends the reader: the agent is out of step
        try:
            if status == wire.OK:
                if slot.target is not None:
                    result = slot.target.copy_(slot.out)
                else:
                    result = slot.out.clone()
            else:
                result = pickle.loads(extra)
        except BaseException as exc:  # noqa: BLE001 - the caller's future gets it
            status, result = wire.FAILED, exc
        with self._lock:
            slot.future = slot.target = None
        if status == wire.FAILED:
            future.set_exception(result)
        else:
            future.set_result(result)

    def _how_ended(self) -> str:
        if self.process is None:
            return "closed its connection"
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "closed its connection"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def _died(self) -> None:
        """The agent is gone: fail every pending and later call, naming it."""
        if self._error is not None:
            return
        if self._closing and (not self._calls or self.process is None):  # leaving anyway
            error = ClusterError("bps is closed")
        else:
            last = f"; its last error: {self._last_error}" if self._last_error else \
                "; it reported no error (see its log above)"
            node = getattr(self, "node_id", self.env.worker_id)
            error = ClusterError(f"the node agent of worker node {node} (pid {self.pid}) "
                                 f"{self._how_ended()}{last}")
            log.error("bps: %s", error)
        with self._lock:
            if self._error is not None:  # a sender that failed got here first
                return
            self._error = error
            pending = [slot.future for slot in self._keys.values() if slot.future is not None]
            for slot in self._keys.values():
                slot.future = slot.target = None
            calls, self._calls = list(self._calls.values()), {}
            pipes = list(self._pipes.values())
        for future in pending + calls:
            if not future.done():
                future.set_exception(error)
        for listener in pipes:
            listener.agent_died(error)
        if self._collectives is not None:
            self._collectives.agent_died(error)
