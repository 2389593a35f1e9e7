"""The gradient pipeline run by the node agent, seen from the training process.

With ``BPS_NODE_AGENT=1`` (and CPU tensors on the host chains), a :class:`SharedPipeline` stands
in for :class:`bps.core.grad_pipeline.GradPipeline` (same interface, same results bit
for bit): each parameter's gradient has a buffer in shared memory, and the pipeline
itself (division, checks, partitions, buckets, chains, pushes, local momentum) runs in
the node agent (:mod:`bps.core.pipeline_agent`) on that buffer, for every local rank of
the node at once. A push is 30 bytes on the agent's socket (the small tensors of one
bucket wait for its last and go in one frame, which the agent pushes in one pass); the
agent writes the average back into the buffer and says so.

With ``install`` (the trainer's pipeline), each parameter's ``.grad`` *is* its buffer
(a view, as DDP's ``gradient_as_bucket_view``): backward accumulates into shared memory,
the hook only counts and announces, and :meth:`SharedPipeline.zero_grads` fills the
buffers with zeros instead of dropping them. A ``.grad`` that was replaced (or set to
None by ``optimizer.zero_grad()``) is copied into the buffer at its push, and the
buffer becomes ``.grad`` again; any other source or destination is copied in and out.

    >>> pipe = SharedPipeline(rt, params, tensors, lr, install=True)   # rt.engine: AgentProxy
    >>> loss.backward()                    # .grad of each parameter: its shared buffer
    >>> for i in range(len(pipe.slots)):
    ...     pipe.push_param(i)              # 30 bytes each; no torch op
    >>> pipe.wait(); skip = pipe.finish(); pipe.end_step(skip is None)
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable

import torch

from bps.common.shm import ALIGN
from bps.compressors.device import forced_by_env
from bps.core.grad_pipeline import GradTensor, SlotQueries
from bps.worker import agent_wire as wire
from bps.worker.agent_proxy import AgentProxy
from bps.worker.engine import Skipped

__all__ = ["SharedPipeline", "runs_in_agent"]


def runs_in_agent(rt, params: dict, tensors: list[GradTensor]) -> bool:
    """Whether the node agent runs the pipeline of ``tensors``: an agent, CPU tensors on
    the host chains, and compression_params that pickle."""
    if not isinstance(carrier_of(rt), AgentProxy) or forced_by_env():
        return False
    if any(t.param.device.type != "cpu" for t in tensors):
        return False
    try:
        pickle.dumps(params)
    except Exception:  # noqa: BLE001 - a callable in the dict: the pipeline stays here
        return False
    return True


def carrier_of(rt) -> AgentProxy | None:
    """This process's connection to the node agent: local rank 0's engine, the other
    local ranks' link (None without an agent)."""
    return rt.engine if rt.engine is not None else getattr(rt, "agent_link", None)


class _Slot:
    """A parameter: its shared buffer (flat ``view``, ``grad`` in its shape) and step."""

    __slots__ = ("name", "param", "group", "view", "grad", "ready", "dest", "done")

    def __init__(self, name: str, param: torch.Tensor, group: int, view: torch.Tensor) -> None:
        self.name, self.param, self.group, self.view = name, param, group, view
        self.grad = view.view(param.shape)
        self.ready = False
        self.dest: torch.Tensor | None = None  # this step's destination, where not ``view``
        self.done: Callable[[int], None] | None = None


def _same(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether ``tensor`` is the memory of the contiguous 1-D ``flat``, element for element."""
    return (tensor.data_ptr() == flat.data_ptr() and tensor.dtype == flat.dtype
            and tensor.numel() == flat.numel() and tensor.is_contiguous()
            and tensor.device.type == "cpu")


class SharedPipeline(SlotQueries):
    """:class:`bps.core.grad_pipeline.GradPipeline`'s interface, run by the node agent.

    Args: as GradPipeline's; ``install``: make each parameter's ``.grad`` its buffer."""

    shared_grads = True
    on_device = False

    def __init__(self, rt, params: dict, tensors: list[GradTensor],
                 lr: Callable[[int], float], rescale: Callable[[], float] | None = None,
                 on_step_start: Callable[[], None] | None = None,
                 on_step_done: Callable[[], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 partition_bytes: int | None = None, install: bool = False) -> None:
        self._rt = rt
        self._engine: AgentProxy = carrier_of(rt)
        self.params = params
        self._lr = lr
        self._rescale = rescale or (lambda: 1.0)
        self.on_step_start, self.on_step_done, self.on_error = (on_step_start, on_step_done,
                                                                on_error)
        self.partition_bytes = partition_bytes or rt.env.partition_bytes
        self.device = torch.device("cpu")
        self._step = self._wire_step = 0
        self.started = False
        self._error: BaseException | None = None
        self._step_done = False
        self._cond = threading.Condition()
        self._compressed: list[int] = []
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._answer_loop, daemon=True,
                                        name="bps-shared-pipeline")
        # one region for every gradient: zeroed at once
        sizes = [-(-t.param.numel() * t.param.element_size() // ALIGN) * ALIGN
                 for t in tensors]
        self.region, (segment, base) = self._engine.shared(max(ALIGN, sum(sizes)))
        self.slots: list[_Slot] = []
        specs, offset = [], 0
        for tensor, size in zip(tensors, sizes, strict=True):
            p = tensor.param
            nbytes = p.numel() * p.element_size()
            view = self.region[offset:offset + nbytes].view(p.dtype)
            self.slots.append(_Slot(tensor.name, p, tensor.group, view))
            specs.append((tensor.name, tuple(p.shape), p.dtype, tensor.group,
                          (segment, base + offset)))
            offset += size
        self._thread.start()
        self.pipe_id = self._engine.attach(self)
        try:
            first = rt.allocate_keys(0)
            count, self._compressed, groups = self._engine.call(
                "pipeline_open", self.pipe_id, params, specs, self.partition_bytes, first,
                waits=2)
        except BaseException:
            self._engine.detach(self.pipe_id)
            self._answers.put(None)
            raise
        # a bucket's members are announced together, once the last is final: the agent
        # then pushes the bucket in one pass instead of a frame and a push per member
        self._group_of = {index: members for members in groups for index in members}
        self._held: dict[int, list[bytes]] = {}  # a bucket's first member -> announced
        # a group's learning rate and momentum rescale this step, read at its first push
        # (neither changes during a step: the optimizer and the scaler step after it)
        self._rates: dict[int, tuple[float, float]] = {}
        if rt.allocate_keys(count) != first:
            raise RuntimeError("keys were allocated while the node agent declared a "
                               "pipeline's keys")
        if install:
            with torch.no_grad():
                for slot in self.slots:
                    self._install(slot)

    # -- counters ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps applied (see GradPipeline)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = int(value)
        self._engine.call("pipeline_counters", self.pipe_id, self._step, self._wire_step)

    @property
    def wire_step(self) -> int:
        """Steps attempted: the step number the pushes carry."""
        return self._wire_step

    @wire_step.setter
    def wire_step(self, value: int) -> None:
        self._wire_step = int(value)
        self._engine.call("pipeline_counters", self.pipe_id, self._step, self._wire_step)

    def compressed_keys(self) -> list[int]:
        return list(self._compressed)

    # -- pushing -----------------------------------------------------------------------

    @staticmethod
    def _install(slot: _Slot) -> None:
        """Make ``slot.grad`` the parameter's ``.grad``, with the values it has now."""
        grad = slot.param.grad
        if grad is slot.grad:
            return
        if grad is None:
            slot.view.zero_()
        else:
            slot.grad.copy_(grad)
        slot.param.grad = slot.grad

    def push_param(self, index: int, absent: bool = False, joined: bool = False) -> None:
        """Push parameter ``index``'s ``.grad`` (zeros where it has none or ``absent``; a
        zero marker where ``joined``); the average lands in ``.grad``, which is its
        buffer from now on. Where ``.grad`` already is: a few Python calls."""
        slot = self.slots[index]
        if slot.ready:
            raise RuntimeError(f"gradient of {slot.name!r} pushed twice in one step")
        if slot.param.grad is not slot.grad:
            with torch.no_grad():
                self._install(slot)
        if absent and not joined:
            slot.view.zero_()
        self._announce(index, slot, joined, None)

    def push(self, index: int, source: torch.Tensor | None, dest: torch.Tensor,
             joined: bool = False, done: Callable[[int], None] | None = None) -> None:
        """GradPipeline's ``push``: ``source`` is copied into the buffer unless it is the
        buffer, the average out of it unless ``dest`` is the buffer."""
        slot = self.check_push(index, dest)
        flat = dest if dest.dim() == 1 else dest.view(-1)
        with torch.no_grad():
            if joined:
                pass
            elif source is None:
                slot.view.zero_()
            elif not _same(source, slot.view):
                slot.view.copy_(source.detach().reshape(-1))
        slot.dest = None if _same(flat, slot.view) else flat
        self._announce(index, slot, joined, done)

    def _announce(self, index: int, slot: _Slot, joined: bool,
                  done: Callable[[int], None] | None) -> None:
        if self._error is not None:
            self.raise_pending_error()
        slot.ready, slot.done = True, done
        if not self.started:
            self.started = True
            if self.on_step_start is not None:
                self.on_step_start()
        flags = (wire.JOINED if joined else 0) | \
            (wire.NOTIFY if done is not None or slot.dest is not None else 0)
        rates = self._rates.get(slot.group)
        if rates is None:  # the group's first push of the step: a few calls a step
            rates = self._rates[slot.group] = (float(self._lr(slot.group)),
                                               float(self._rescale()))
        record = wire.grad_record(self.pipe_id, index, flags, *rates)
        members = self._group_of.get(index)
        if members is None:
            self._engine.send(wire.pack_grads([record]))
            return
        held = self._held.setdefault(members[0], [])
        held.append(record)
        if len(held) == len(members):
            del self._held[members[0]]
            self._engine.send(wire.pack_grads(held))

    def zero_grads(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()`` for gradients in shared memory: the buffers are
        filled with zeros and stay ``.grad``; a ``.grad`` that is not its buffer is set
        to None (``set_to_none``) or zeroed."""
        with torch.no_grad():
            if all(slot.param.grad is slot.grad for slot in self.slots):
                self.region.zero_()
                return
            for slot in self.slots:
                grad = slot.param.grad
                if grad is slot.grad:
                    slot.view.zero_()
                elif grad is not None:
                    if set_to_none:
                        slot.param.grad = None
                    else:
                        grad.zero_()

    # -- the agent's answers -------------------------------------------------------------

    def agent_frame(self, kind: int, index: int, extra: bytes) -> None:
        """A frame of the agent (on the proxy's reader thread): handled on this
        pipeline's thread, where ``done`` and ``on_step_done`` may call the agent."""
        self._answers.put((kind, index, extra))

    def _answer_loop(self) -> None:
        while True:
            item = self._answers.get()
            if item is None:
                return
            self._answer(*item)

    def _answer(self, kind: int, index: int, extra: bytes) -> None:
        try:
            if kind == wire.GRAD_DONE:
                slot = self.slots[index]
                if slot.dest is not None:
                    slot.dest.copy_(slot.view)
                if slot.done is not None:
                    slot.done(index)
            elif kind == wire.STEP_DONE:
                with self._cond:
                    self._step_done = True
                    self._cond.notify_all()
                if self.on_step_done is not None:
                    self.on_step_done()
            elif kind == wire.PIPE_ERROR:
                self._fail(pickle.loads(extra))
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._fail(exc)

    def agent_died(self, error: BaseException) -> None:
        self._fail(error)

    # -- settling a step -----------------------------------------------------------------

    def raise_pending_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"bps communication failed: {self._error}") from self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until the agent wrote every parameter's average (GradPipeline's)."""
        timeout = self._rt.env.timeout * 2 if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._step_done and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s.name for s in self.slots if not s.ready] or \
                        [s.name for s in self.slots]
                    raise TimeoutError(f"step {self._step}: gradients still in flight after "
                                       f"{timeout:g}s: {missing[:5]}")
                self._cond.wait(left)
        self.raise_pending_error()

    def finish(self) -> Skipped | None:
        """GradPipeline's ``finish``, in the agent (one call); destinations outside the
        buffers get NaN too where a gradient was not finite, zeros where worker nodes left
        (and this process's runtime learns who is present)."""
        skip = self._engine.call("pipeline_finish", self.pipe_id)
        if skip is not None and skip.reason == "membership":
            self._rt.set_membership(skip.generation, list(skip.members))
        if skip is not None and skip.reason in ("nonfinite", "membership"):
            fill = float("nan") if skip.reason == "nonfinite" else 0.0
            with torch.no_grad():
                for slot in self.slots:
                    if slot.dest is not None:
                        slot.dest.fill_(fill)
        return skip

    def end_step(self, applied: bool) -> None:
        for slot in self.slots:
            slot.ready, slot.dest, slot.done = False, None, None
        self._held.clear()
        self._rates.clear()
        self.started = False
        with self._cond:
            self._step_done = False
        self._wire_step += 1
        if applied:
            self._step += 1
        self._engine.send(wire.pack_pipe(wire.END_STEP, self.pipe_id, int(applied)))

    # -- state ---------------------------------------------------------------------------

    def momentum_state(self) -> dict:
        return self._engine.call("pipeline_momentum", self.pipe_id)

    def load_momentum_state(self, state: dict) -> None:
        self._engine.call("pipeline_load_momentum", self.pipe_id, state)

    def close(self) -> None:
        """Stop the agent's pipeline (where the agent is still there)."""
        self._engine.detach(self.pipe_id)
        if self._error is None:
            try:
                self._engine.call("pipeline_close", self.pipe_id)
            except Exception:  # noqa: BLE001 - the agent is gone or closing: nothing runs
                pass
        self._answers.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
