"""The node agent that also runs gradient pipelines (``BPS_NODE_AGENT=1``).

:class:`PipelineAgent` is :class:`bps.worker.agent.Agent` (the node's engine in a process
of its own) plus the training process's :class:`bps.core.grad_pipeline.GradPipeline`:
the gradients lie in shared memory (each parameter's ``.grad`` is a view into a buffer
the agent maps too), a gradient that is final is announced in 30 bytes (GRAD), and the
agent divides it, checks it, cuts it into partitions, compresses, pushes, pulls and
writes the average back into the same buffer, with the same code and so the same bits
as the pipeline in the training process. The training process's side is
:class:`bps.core.shared_pipeline.SharedPipeline`.

Started by ``bps.init()`` on a node of one local rank::

    python -m bps.core.pipeline_agent FD PARENT_PID
"""

from __future__ import annotations

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

__all__ = ["PipelineAgent"]


class _AgentRuntime:
    """What a :class:`GradPipeline` reads of its runtime, in the agent: one local rank,
    the agent's engine, and keys numbered from the training process's next key."""

    local_rank, local_size = 0, 1

    def __init__(self, env: ClusterEnv, engine: Any, tracer: Any, first_key: int) -> None:
        self.env, self.engine, self.tracer = env, engine, tracer
        self.size = engine.num_workers
        self.group = LocalGroup.connect(0, 1, "127.0.0.1", 0)
        self.first_key = self.next_key = first_key
        self._names = 0
        self._lock = threading.Lock()

    def allocate_keys(self, count: int) -> int:
        with self._lock:
            first, self.next_key = self.next_key, self.next_key + count
            return first

    def unique_name(self, prefix: str) -> str:
        with self._lock:
            self._names += 1
            return f"{prefix}{self._names}"


class _Hosted:
    """A pipeline run here: its buffers and the learning rates its pushes carried."""

    def __init__(self, agent: PipelineAgent, pipe_id: int) -> None:
        self.agent, self.pipe_id = agent, pipe_id
        self.pipe: GradPipeline | None = None
        self.views: list[torch.Tensor] = []
        self.lrs: dict[int, float] = {}
        self.scale = 1.0

    def done(self, index: int) -> None:
        self.agent.send(wire.pack_pipe(wire.GRAD_DONE, self.pipe_id, index))

    def step_done(self) -> None:
        self.agent.send(wire.pack_pipe(wire.STEP_DONE, self.pipe_id))

    def failed(self, exc: BaseException) -> None:
        self.agent.send(wire.pack_pipe(wire.PIPE_ERROR, self.pipe_id, 0,
                                       agent_base.pickled_error(exc)))


class PipelineAgent(agent_base.Agent):
    """The node agent, serving pipelines too (see the module's docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipes: dict[int, _Hosted] = {}

    def call_pipeline_open(self, pipe_id: int, params: dict, tensors: list[tuple],
                           partition_bytes: int, first_key: int) -> tuple[int, list[int]]:
        """Build pipeline ``pipe_id`` over ``tensors`` (name, shape, dtype, group, where:
        its gradient's buffer) and declare its keys from ``first_key`` on; returns how
        many keys it took and its compressed keys."""
        hosted = _Hosted(self, pipe_id)
        grads = []
        for name, shape, dtype, group, where in tensors:
            numel = 1
            for size in shape:
                numel *= size
            view = self._view(where, numel, dtype)
            hosted.views.append(view)
            grads.append(GradTensor(name, view.view(shape), group))
        rt = _AgentRuntime(self.env, self.engine, self.tracer, first_key)
        hosted.pipe = GradPipeline(rt, params, grads, lambda group: hosted.lrs[group],
                                   lambda: hosted.scale, on_step_done=hosted.step_done,
                                   on_error=hosted.failed, partition_bytes=partition_bytes)
        self.pipes[pipe_id] = hosted
        return rt.next_key - rt.first_key, hosted.pipe.compressed_keys()

    def call_pipeline_finish(self, pipe_id: int):
        return self.pipes[pipe_id].pipe.finish()

    def call_pipeline_counters(self, pipe_id: int, step: int, wire_step: int) -> None:
        pipe = self.pipes[pipe_id].pipe
        pipe.step, pipe.wire_step = step, wire_step

    def call_pipeline_momentum(self, pipe_id: int) -> dict:
        return self.pipes[pipe_id].pipe.momentum_state()

    def call_pipeline_load_momentum(self, pipe_id: int, state: dict) -> None:
        self.pipes[pipe_id].pipe.load_momentum_state(state)

    def call_pipeline_close(self, pipe_id: int) -> None:
        hosted = self.pipes.pop(pipe_id, None)
        if hosted is not None:
            hosted.pipe.close()

    def call_close(self, failure: str | None) -> None:
        for hosted in self.pipes.values():
            hosted.pipe.close()
        self.pipes.clear()
        super().call_close(failure)

    def on_frame(self, kind: int, body: bytes) -> None:
        if kind == wire.GRAD:
            pipe_id, index, flags, lr, scale = wire.unpack_grad(body)
            hosted = self.pipes[pipe_id]
            hosted.lrs[hosted.pipe.slots[index].group] = lr
            hosted.scale = scale
            view = hosted.views[index]
            try:
                hosted.pipe.push(index, view, view, joined=bool(flags & wire.JOINED),
                                 done=hosted.done if flags & wire.NOTIFY else None)
            except Exception as exc:  # noqa: BLE001 - the training process's wait raises it
                hosted.failed(exc)
        elif kind == wire.END_STEP:
            pipe_id, applied, _ = wire.unpack_pipe(body)
            self.pipes[pipe_id].pipe.end_step(bool(applied))
        else:
            super().on_frame(kind, body)


if __name__ == "__main__":
    code = agent_base.main(sys.argv[1:], PipelineAgent)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
