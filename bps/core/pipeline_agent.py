"""The node agent that also runs gradient pipelines (``BPS_NODE_AGENT=1``).

:class:`PipelineAgent` is :class:`bps.worker.agent.Agent` (the node's engine in a process
of its own) plus the training processes' :class:`bps.core.grad_pipeline.GradPipeline`:
the gradients lie in shared memory (each parameter's ``.grad`` is a view into a buffer
the agent maps too), a gradient that is final is announced in 30 bytes (GRAD; the
members of a bucket of small tensors together, once its last is final), and the
agent divides it, checks it, cuts it into partitions, compresses, pushes, pulls and
writes the average back into the same buffer, with the same code and so the same bits
as the pipeline in the training process. The training process's side is
:class:`bps.core.shared_pipeline.SharedPipeline`.

A node of several local ranks has one pipeline here for all of them: once every local
rank has announced a parameter, the pipeline pushes local rank 0's buffer as local rank
0 would, and its reduce takes the node's sum (each rank's share as that rank would
divide it, summed in rank order in the node's dtype: :mod:`bps.worker.local_sum`); the
average is then copied into every rank's buffer.

Started by ``bps.init()`` on local rank 0::

    python -m bps.core.pipeline_agent FD PARENT_PID
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from typing import Any

import torch

from bps.common.env import ClusterEnv
from bps.core.grad_pipeline import GradPipeline, GradTensor
from bps.worker import agent as agent_base
from bps.worker import agent_wire as wire
from bps.worker.intranode import LocalGroup
from bps.worker.local_sum import sum_in_rank_order

__all__ = ["PipelineAgent"]


class _NodeChannel:
    """The pipeline's channels in the agent: the reduce adds the other local ranks'
    shares to local rank 0's (the broadcast and flags have nothing to do: the agent
    copies the average into every rank's buffer)."""

    def __init__(self, node: _NodePipe, reduces: bool) -> None:
        self.node, self.reduces = node, reduces

    def reduce(self, tensor: torch.Tensor) -> None:
        if self.reduces:
            self.node.add_shares(tensor)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        pass


class _NodeGroup:
    def __init__(self, node: _NodePipe) -> None:
        self.node = node

    def channel(self, name: str) -> _NodeChannel:
        return _NodeChannel(self.node, name.startswith("reduce"))


class _Membership:
    """The worker nodes the agent's pipelines divide by, one for all of them as the
    training process's runtime is (a pipeline that settles a step of a new membership
    moves every pipeline to it, as ``Runtime.set_membership`` does in process; so does
    a node's join)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation = 0
        self.members: list[int] = []  # set from the engine's first

    def start(self, engine: Any) -> None:
        with self.lock:
            if not self.members:
                self.generation, self.members = engine.generation, sorted(engine.members)

    def set(self, generation: int, members: list[int]) -> None:
        with self.lock:
            if generation > self.generation:
                self.generation, self.members = generation, sorted(members)


_MEMBERSHIP = _Membership()


class _AgentRuntime:
    """What a :class:`GradPipeline` reads of its runtime, in the agent: the node's local
    ranks, the agent's engine, the node's membership (:class:`_Membership`), and keys
    numbered from the training processes' next key."""

    local_rank = 0

    def __init__(self, env: ClusterEnv, engine: Any, tracer: Any, first_key: int,
                 node: _NodePipe) -> None:
        self.env, self.engine, self.tracer, self.node = env, engine, tracer, node
        self.local_size = node.size
        _MEMBERSHIP.start(engine)
        self.group = LocalGroup.connect(0, 1, "127.0.0.1", 0) if node.size == 1 \
            else _NodeGroup(node)
        self.first_key = self.next_key = first_key
        self._names = 0
        self._lock = threading.Lock()

    def allocate_keys(self, count: int) -> int:
        with self._lock:
            first, self.next_key = self.next_key, self.next_key + count
            return first

    @property
    def generation(self) -> int:
        return _MEMBERSHIP.generation

    @property
    def members(self) -> list[int]:
        return _MEMBERSHIP.members

    @property
    def size(self) -> int:
        """The job's ranks present: what each rank divides by."""
        return len(_MEMBERSHIP.members) * self.local_size

    def set_membership(self, generation: int, members: list[int]) -> None:
        """Runtime.set_membership: the node's local ranks divide by the ranks present."""
        _MEMBERSHIP.set(generation, members)

    def unique_name(self, prefix: str) -> str:
        with self._lock:
            self._names += 1
            return f"{prefix}{self._names}"


class _NodePipe:
    """One pipeline of every local rank: their buffers, their announcements, the
    learning rates they carried."""

    def __init__(self, pipe_id: int, size: int) -> None:
        self.pipe_id, self.size = pipe_id, size
        self.pipe: GradPipeline | None = None
        self.error: BaseException | None = None
        self.ranks: dict[int, tuple[PipelineAgent, list[torch.Tensor]]] = {}
        self.cond = threading.Condition()
        self.pushing = threading.Lock()  # one push into the pipeline at a time
        self.lrs: dict[int, float] = {}
        self.scale = 1.0
        self.arrived: dict[int, list[int]] = {}  # index -> local ranks that announced it
        self.notify: dict[int, set[int]] = {}  # index -> local ranks that want GRAD_DONE
        self.ends = 0
        self.closed = 0  # ranks that closed it
        self.finished: tuple[int, Any] | None = None  # (wire step, finish()'s result)
        self.by_share: dict[int, int] = {}  # a slot's node share (data_ptr) -> its index
        self.scratch: torch.Tensor | None = None
        self.runtime: _AgentRuntime | None = None  # the pipeline's, once built
        self.key_count = 0

    # -- building --------------------------------------------------------------------

    def open(self, rank: int, agent: PipelineAgent, views: list[torch.Tensor],
             build: Any, timeout: float) -> GradPipeline:
        """Register local rank ``rank``'s buffers; the last rank builds the pipeline
        (``build()``), the others wait for it (up to ``timeout`` s)."""
        with self.cond:
            self.ranks[rank] = (agent, views)
            last = len(self.ranks) == self.size
        if last:
            try:
                self.pipe = build()
            except BaseException as exc:
                self.error = exc
                raise
            finally:
                with self.cond:
                    self.cond.notify_all()
            return self.pipe
        with self.cond:
            if not self.cond.wait_for(lambda: self.pipe is not None or self.error is not None,
                                      timeout):
                raise TimeoutError(f"pipeline {self.pipe_id}: the node's other local ranks "
                                   f"did not declare it within {timeout:g} s")
        if self.error is not None:
            raise RuntimeError(f"pipeline {self.pipe_id}: {self.error}")
        return self.pipe

    def add_shares(self, share: torch.Tensor) -> None:
        """Local rank 0's share (of a parameter) += the other ranks', in rank order, each
        divided as its rank would (GradPipeline.push with several local ranks)."""
        index = self.by_share[share.data_ptr()]
        size = self.runtime.size
        parts = [share]
        numel = share.numel()
        if self.scratch is None or self.scratch.numel() < numel * (self.size - 1) \
                or self.scratch.dtype != share.dtype:
            self.scratch = torch.empty(numel * (self.size - 1), dtype=share.dtype)
        for rank in range(1, self.size):
            grad = self.ranks[rank][1][index]
            out = self.scratch[(rank - 1) * numel:rank * numel]
            if out.dtype == grad.dtype:
                torch.div(grad, size, out=out)
            else:  # divide in float32 first, so a float16 share cannot overflow
                out.copy_(grad.float().div(size))
            parts.append(out)
        sum_in_rank_order(share, parts)

    # -- a step ------------------------------------------------------------------------

    def arrive(self, rank: int, index: int, flags: int, lr: float, scale: float) -> None:
        """Local rank ``rank`` announced parameter ``index``: the last one pushes it."""
        if self.size == 1:  # a node of one local rank: nothing to count or wait for
            self._note(rank, index, flags, lr, scale)
            self._push(index, flags)
            return
        with self.cond:
            ranks = self.arrived.setdefault(index, [])
            ranks.append(rank)
            if flags & wire.NOTIFY:
                self.notify.setdefault(index, set()).add(rank)
            if rank == 0:
                self.lrs[self.pipe.slots[index].group] = lr
                self.scale = scale
            if len(ranks) < self.size:
                return
            del self.arrived[index]
        self._push(index, flags)

    def _note(self, rank: int, index: int, flags: int, lr: float, scale: float) -> None:
        """What a lone local rank's announcement of ``index`` tells: whether it wants
        GRAD_DONE, its group's learning rate, the momentum scale."""
        if flags & wire.NOTIFY:
            self.notify.setdefault(index, set()).add(rank)
        self.lrs[self.pipe.slots[index].group] = lr
        self.scale = scale

    def arrive_fused(self, rank: int, records: list[tuple]) -> None:
        """Local rank ``rank`` announced the members of a bucket at once (``records``:
        ``(pipeline, index, flags, lr, scale)`` each, as :meth:`arrive` takes them): on
        a node of one local rank they are pushed together."""
        if self.size > 1:
            for _, index, flags, lr, scale in records:
                self.arrive(rank, index, flags, lr, scale)
            return
        items = []
        for _, index, flags, lr, scale in records:
            self._note(rank, index, flags, lr, scale)
            view = self.ranks[0][1][index]
            items.append((index, view, view, bool(flags & wire.JOINED), self.done))
        with self.pushing:
            try:
                self.pipe.push_fused(items)
            except Exception as exc:  # noqa: BLE001 - the training processes' wait raises it
                self.failed(exc)

    def _push(self, index: int, flags: int) -> None:
        view = self.ranks[0][1][index]
        # the pipeline compresses inline: under a lock of its own, not ``cond``, which
        # the I/O thread takes to answer a parameter that is done
        with self.pushing:
            try:
                self.pipe.push(index, view, view, joined=bool(flags & wire.JOINED),
                               done=self.done)
            except Exception as exc:  # noqa: BLE001 - the training processes' wait raises it
                self.failed(exc)

    def done(self, index: int) -> None:
        """Parameter ``index``'s average is in local rank 0's buffer: into every rank's."""
        source = self.ranks[0][1][index]
        for rank in range(1, self.size):
            self.ranks[rank][1][index].copy_(source)
        asking = ()
        if self.notify:  # this index's entry, if any, was added before its push
            with self.cond:
                asking = self.notify.pop(index, ())
        for rank in asking:
            self.ranks[rank][0].send(wire.pack_pipe(wire.GRAD_DONE, self.pipe_id, index))

    def step_done(self) -> None:
        for agent, _ in self.ranks.values():
            agent.send(wire.pack_pipe(wire.STEP_DONE, self.pipe_id))

    def failed(self, exc: BaseException) -> None:
        frame = wire.pack_pipe(wire.PIPE_ERROR, self.pipe_id, 0,
                               agent_base.pickled_error(exc))
        for agent, _ in self.ranks.values():
            agent.send(frame)

    def finish(self):
        """GradPipeline.finish, once a step for every rank (NaN into every rank's
        buffers where a gradient was not finite)."""
        with self.cond:
            if self.finished is not None and self.finished[0] == self.pipe.wire_step:
                return self.finished[1]
            skip = self.pipe.finish()
            if skip is not None and skip.reason in ("nonfinite", "membership"):
                fill = float("nan") if skip.reason == "nonfinite" else 0.0
                for rank in range(1, self.size):
                    for view in self.ranks[rank][1]:
                        view.fill_(fill)
            self.finished = (self.pipe.wire_step, skip)
            return skip

    def end_step(self, applied: bool) -> None:
        """A rank counted the step: the last one counts it here."""
        with self.cond:
            self.ends += 1
            if self.ends < self.size:
                return
            self.ends = 0
        self.pipe.end_step(applied)


_NODE: dict[int, _NodePipe] = {}  # this node's pipelines, by number (the same on each rank)
_NODE_LOCK = threading.Lock()


class PipelineAgent(agent_base.Agent):
    """The node agent, serving pipelines too (see the module's docs)."""

    def _node_pipe(self, pipe_id: int) -> _NodePipe:
        with _NODE_LOCK:
            if pipe_id not in _NODE:
                _NODE[pipe_id] = _NodePipe(pipe_id, self.env.local_size)
            return _NODE[pipe_id]

    def call_pipeline_open(self, pipe_id: int, params: dict, tensors: list[tuple],
                           partition_bytes: int, first_key: int
                           ) -> tuple[int, list[int], list[list[int]]]:
        """Build pipeline ``pipe_id`` over ``tensors`` (name, shape, dtype, group, where:
        its gradient's buffer) once every local rank has declared it, with keys from
        ``first_key`` on; returns how many keys it took, its compressed keys and its
        buckets' members (``GradPipeline.fused_groups``: each announced in one GRAD)."""
        node = self._node_pipe(pipe_id)
        views = []
        for _, shape, dtype, _, where in tensors:
            numel = 1
            for size in shape:
                numel *= size
            views.append(self.view(where, numel, dtype))
        def build() -> GradPipeline:
            grads = [GradTensor(name, view.view(shape), group) for (name, shape, _, group, _),
                     view in zip(tensors, node.ranks[0][1], strict=True)]
            rt = _AgentRuntime(self.env, self.engine, self.tracer, first_key, node)
            pipe = GradPipeline(rt, params, grads, lambda group: node.lrs[group],
                                lambda: node.scale, on_step_done=node.step_done,
                                on_error=node.failed, partition_bytes=partition_bytes,
                                inline=True)
            node.key_count, node.runtime = rt.next_key - rt.first_key, rt
            for index, slot in enumerate(pipe.slots):  # the node's shares (several ranks)
                if slot.send is not None:
                    node.by_share[slot.send.data_ptr()] = index
            return pipe

        pipe = node.open(self.local_rank, self, views, build, 2 * self.env.timeout)
        # what the job keeps to its end (modules, chains, buffers) out of the collector's
        # full passes: each step's futures and requests make it run every few steps
        gc.freeze()
        return node.key_count, pipe.compressed_keys(), pipe.fused_groups()

    def call_set_membership(self, generation: int, members: list[int]) -> None:
        """A joining node: its engine and its pipelines push with the membership it
        joined."""
        super().call_set_membership(generation, members)
        _MEMBERSHIP.set(generation, members)

    def call_pipeline_finish(self, pipe_id: int):
        return _NODE[pipe_id].finish()

    def call_pipeline_counters(self, pipe_id: int, step: int, wire_step: int) -> None:
        pipe = _NODE[pipe_id].pipe
        pipe.step, pipe.wire_step = step, wire_step

    def call_pipeline_momentum(self, pipe_id: int) -> dict:
        return _NODE[pipe_id].pipe.momentum_state()

    def call_pipeline_load_momentum(self, pipe_id: int, state: dict) -> None:
        _NODE[pipe_id].pipe.load_momentum_state(state)

    def call_pipeline_close(self, pipe_id: int) -> None:
        """A rank closed the pipeline: the last one stops it."""
        with _NODE_LOCK:
            node = _NODE.get(pipe_id)
            if node is None:
                return
            node.closed += 1
            if node.closed < node.size:
                return
            del _NODE[pipe_id]
        if node.pipe is not None:
            node.pipe.close()

    def call_close(self, failure: str | None) -> None:
        with _NODE_LOCK:
            nodes = list(_NODE.values())
            _NODE.clear()
        for node in nodes:
            if node.pipe is not None:
                node.pipe.close()
        super().call_close(failure)

    def on_frame(self, kind: int, body: bytes) -> None:
        if kind == wire.GRAD:
            records = wire.unpack_grads(body)
            if len(records) == 1:
                pipe_id, index, flags, lr, scale = records[0]
                _NODE[pipe_id].arrive(self.local_rank, index, flags, lr, scale)
            else:  # a bucket's members
                _NODE[records[0][0]].arrive_fused(self.local_rank, records)
        elif kind == wire.END_STEP:
            pipe_id, applied, _ = wire.unpack_pipe(body)
            _NODE[pipe_id].end_step(bool(applied))
        else:
            super().on_frame(kind, body)


if __name__ == "__main__":
    code = agent_base.main(sys.argv[1:], PipelineAgent)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
