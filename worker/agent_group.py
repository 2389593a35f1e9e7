"""The collectives between a node's local ranks through its node agent, without gloo.

With ``BPS_NODE_AGENT=1`` and several local ranks, every local rank is connected to the
node agent (local rank 0 started it; the others connect to :func:`socket_name`), and
:class:`AgentGroup` stands in for :class:`bps.worker.intranode.LocalGroup`: a
collective copies the rank's tensor into a staging buffer in shared memory and
announces it; once every local rank has, the agent's :class:`Hub` sums the buffers in
local-rank order in their dtype (:func:`bps.worker.local_sum.sum_in_rank_order`) or
copies the root's into the others', and answers each rank, which copies the result out.

    group = AgentGroup(proxy, local_rank, local_size, timeout_s=60)   # proxy: AgentProxy
    group.channel("reduce").reduce(grad)   # local rank 0 now holds the node's sum
    group.channel("broadcast").broadcast(grad)
    group.close()

A channel's collectives are matched by their order, as gloo's are: one thread at a time
per channel, the same sequence on every local rank.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import threading
from typing import Any

import torch

from bps.worker import agent_wire as wire
from bps.worker.intranode import IntraNodeError
from bps.worker.local_sum import sum_in_rank_order

__all__ = ["AgentChannel", "AgentGroup", "Hub", "socket_name"]

REDUCE, BROADCAST = 0, 1
_OPS = {REDUCE: "reduce", BROADCAST: "broadcast"}


def socket_name(job: int, node: int | None) -> str:
    """The abstract Unix socket where node ``node``'s agent of job ``job`` (the
    scheduler's port) takes the connections of local ranks 1, 2, ...

        >>> socket_name(9000, 1)
        '\\x00bps-agent-9000-1'
    """
    return f"\0bps-agent-{job}-{node or 0}"


# ----------------------------------------------------------------------------- agent side


class Hub:
    """The agent's side: collects each collective's arrivals and answers them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], dict[int, tuple]] = {}

    def arrive(self, rank: int, agent: Any, body: bytes) -> None:
        """Local rank ``rank``'s collective (a COLL frame's ``body``), served by ``agent``
        (which maps the rank's segments and sends to it)."""
        name, seq, op, root, dtype, numel, where = pickle.loads(body)
        view = agent.view(where, numel, dtype)
        with self._lock:
            entry = self._pending.setdefault((name, seq), {})
            entry[rank] = (agent, op, root, dtype, numel, view)
            if len(entry) < self.size:
                return
            del self._pending[(name, seq)]
        error = ""
        try:
            shapes = {(op, root, dtype, numel) for _, op, root, dtype, numel, _ in
                      entry.values()}
            if len(shapes) > 1:
                raise IntraNodeError(f"the local ranks disagree on collective {seq} of "
                                     f"channel {name!r}: {sorted(map(str, shapes))}")
            views = [entry[r][5] for r in range(self.size)]
            if op == REDUCE:
                sum_in_rank_order(views[0], views)
            else:
                for r in range(self.size):
                    if r != root:
                        views[r].copy_(views[root])
        except Exception as exc:  # noqa: BLE001 - every rank's collective fails with it
            error = f"{type(exc).__name__}: {exc}"
        answer = pickle.dumps((name, seq, error))
        for r in range(self.size):
            entry[r][0].send(wire.pack(wire.COLL_DONE, answer))


# ----------------------------------------------------------------------------- training side


class AgentChannel:
    """One ordered stream of collectives (:class:`bps.worker.intranode.LocalChannel`'s
    interface) through the node agent."""

    def __init__(self, name: str, group: AgentGroup) -> None:
        self.name, self.group = name, group
        self.rank, self.size = group.rank, group.size
        self._seq = 0
        self._staging: torch.Tensor | None = None
        self._where: tuple[int, int] = (0, 0)

    def _run(self, op: int, tensor: torch.Tensor, root: int) -> None:
        if tensor.device.type != "cpu":
            raise IntraNodeError(f"intra-node {_OPS[op]} on channel {self.name!r}: "
                                 f"BPS_NODE_AGENT=1 takes CPU tensors only, not {tensor.device}")
        nbytes = tensor.numel() * tensor.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging, self._where = self.group.carrier.shared(max(nbytes, 64))
        view = self._staging[:nbytes].view(tensor.dtype)
        if op == REDUCE or self.rank == root:
            view.copy_(tensor.reshape(-1))
        seq = self._seq
        self._seq += 1
        future = self.group.expect(self.name, seq)
        self.group.carrier.send(wire.pack(wire.COLL, pickle.dumps(
            (self.name, seq, op, root, tensor.dtype, tensor.numel(), self._where))))
        try:
            error = future.result(timeout=self.group.timeout_s)
        except concurrent.futures.TimeoutError:
            error = f"no answer from the node agent within {self.group.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - the agent is gone: named in exc
            error = str(exc)
        if error:
            raise IntraNodeError(
                f"intra-node {_OPS[op]} on channel {self.name!r} (local rank {self.rank} of "
                f"{self.size}, {tensor.numel()} x {tensor.dtype}) failed: {error}")
        if (op == REDUCE and self.rank == 0) or (op == BROADCAST and self.rank != root):
            with torch.no_grad():
                tensor.copy_(view.view(tensor.shape))

    def reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the local ranks into local rank 0's ``tensor`` (in place)."""
        self._run(REDUCE, tensor, 0)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Overwrite ``tensor`` on every local rank with local rank ``root``'s ``tensor``."""
        self._run(BROADCAST, tensor, root)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Local rank 0's ``data`` on every local rank (others pass ``None``)."""
        length = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self.broadcast(length)
        buf = torch.zeros(int(length.item()), dtype=torch.uint8)
        if self.rank == 0 and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf)
        return bytes(buf.numpy().tobytes())

    def barrier(self) -> None:
        """Block until every local rank has reached this call (bounded by the timeout)."""
        self.broadcast(torch.zeros(1))


class AgentGroup:
    """The local ranks of one node, through its agent (``carrier``: this process's
    :class:`bps.worker.agent_proxy.AgentProxy`); LocalGroup's interface."""

    def __init__(self, carrier: Any, rank: int, size: int, timeout_s: float) -> None:
        self.carrier, self.rank, self.size = carrier, rank, size
        self.timeout_s = timeout_s
        self._channels: dict[str, AgentChannel] = {}
        self._lock = threading.Lock()
        self._futures: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._error: BaseException | None = None
        carrier.watch_collectives(self)

    def channel(self, name: str) -> AgentChannel:
        """The channel called ``name`` (created on first use; every local rank must ask)."""
        if name not in self._channels:
            self._channels[name] = AgentChannel(name, self)
        return self._channels[name]

    def expect(self, name: str, seq: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                self._futures[(name, seq)] = future
        return future

    def collective_done(self, body: bytes) -> None:
        """A COLL_DONE frame (the carrier's reader thread)."""
        name, seq, error = pickle.loads(body)
        with self._lock:
            future = self._futures.pop((name, seq), None)
        if future is not None:
            future.set_result(error)

    def agent_died(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            future.set_exception(error)

    def close(self, destroy: bool = True) -> None:
        """Forget the channels (the carrier is closed by its owner)."""
        self._channels.clear()
