"""A parameter server's sums, with no sockets and no threads: per key, the pushes of a
step in, the step's aggregate out.

Usage::

    >>> import numpy as np
    >>> sums = Aggregator(workers=2)
    >>> _ = sums.register(5, numel=3, dtype=torch.float32, params=None, name="w", node=0)
    >>> def push(node: int) -> Pushed:   # a raw float32 push of [1, 2, 3]
    ...     body = bytearray(np.array([1, 2, 3], np.float32).tobytes())
    ...     return sums.push(5, node=node, step=0, payload=[body], lr=0.1, waiter=node)
    >>> push(1).finished            # held until node 0's push is added
    []
    >>> done, = push(0).finished
    >>> done.waiters, done.payload.tolist()
    ([1, 0], [2.0, 4.0, 6.0])

Per key and step: each worker node's push is decompressed and added to the step's sum
(float32, float64 for float64 keys; a sum of two float16/bfloat16 pushes is taken in
that dtype, which rounds exactly as the float32 sum does) in worker-node order: a push
that arrives before those of lower-numbered nodes is acknowledged and kept (its buffers,
undecoded) until they have been added. The sum's rounding, and with it a whole job's
results, then does not depend on which node was faster (a run is reproducible from its
seeds, as with DDP's fixed allreduce order). There are five ways of adding a push:

* raw, one buffer: the step's first push is the sum itself (or its widened copy), a
  later one is added where it lies (widened first where the sum is wider);
* raw, several buffers: each buffer is checked and added where it lies, or, where a
  buffer cuts an element or the sum is wider, joined first;
* compressed, summed in place (the sum is in the key's own dtype): the first push is
  decoded into a reused buffer, the next ones are added by the chain's
  ``decompress_add`` (a sparse payload touches only its k elements);
* compressed, widened (a float16/bfloat16 key of more than two workers): decoded, then
  added in float32;
* compressed, summed by the server chain itself (``sums_payloads``: onebit, bytegrad):
  the payloads are checked as they arrive and summed in the chain's error feedback pass
  (``compress_sum``) once the last is in.

When all ``workers`` nodes have pushed step s (and every earlier step is done), the
server chain gets ``set_lr(lr)`` from the step's first push with values and compresses
the sum once; every push and pull of step s is answered with those same bytes
(:class:`Finished`). Pushes for later steps accumulate separately, so a fast worker's
step s+1 never mixes into s. A bad push raises :class:`RequestError`, naming the key and
the field, with nothing added.

Non-finite gradients: a push whose values are inf or NaN is refused, naming the node
(workers never send one: they mark it, see ``bps.common.protocol``). A step of a key with a
``nonfinite`` mark is answered with a skip and nothing summed; the server chain then
stays as it was. So is a key whose finite pushes sum beyond its dtype's range (float16
raw keys; compressed keys once the server chain's error is added): ``skip_node`` -1.
Where a worker learns that the whole step is skipped (another key's mark), node 0 sends
``ABORT`` for its keys (:meth:`Aggregator.abort`): a chain that compressed that step
returns to its state before it (error feedback keeps the previous error buffer for
this, see ``Compressor.rollback``).

``workers`` is a plain attribute: the number of worker nodes the job started with (node
ids ``0 .. workers - 1``). ``members``, the node ids whose pushes make a step, are all of
them until :meth:`Aggregator.set_members` announces another membership (a worker node
left the job; docs/runtime.md, "Elastic membership"), with its ``generation``. A step
still waits for every node it was started with, unless it is *dropped*: a membership
change drops every step in progress that holds a push of an older generation than the
new one (every push carries the generation its worker divided by), and a push of an
older generation drops its step where it arrives later. A dropped step sums nothing: it
waits for every present member's push, then answers each waiter with a skip
``"membership"`` that carries the new ``generation`` and ``members``; the server chain
does not change. So every worker gets the same answer for every key, and the workers
skip that step as a whole (and roll back, as for a non-finite gradient). A push of a
node that is not a member is refused, naming the generation it left at.

    >>> sums = Aggregator(workers=3)
    >>> _ = sums.register(1, numel=2, dtype=torch.float32, params=None, name="b", node=0)
    >>> raw = lambda: [bytearray(np.ones(2, np.float32).tobytes())]
    >>> _ = sums.push(1, node=0, step=0, payload=raw(), lr=0.1, waiter="w0")
    >>> sums.set_members(1, [0, 1]).finished       # node 2 left: step 0 is dropped
    []
    >>> done, = sums.push(1, node=1, step=0, payload=raw(), lr=0.1, waiter="w1").finished
    >>> done.skip["skip"], done.skip["members"], done.waiters
    ('membership', [0, 1], ['w0', 'w1'])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from bps.common.protocol import dtype_name, error_text, join_frames
from bps.compressors.base import NonFiniteError
from bps.compressors.finite import frames_finite, join_finite, tensor_finite
from bps.compressors.threads import chunk_bounds, run_chunks

log = logging.getLogger("bps.server")

MAX_PENDING_STEPS = 16
STEP_WINDOW = 1  # a push's step may differ by at most this from the pending pushes' steps


class RequestError(ValueError):
    """A request the server refuses; the message goes back in an ERROR reply."""


class Push(NamedTuple):
    """One worker node's push of a step: its payload's buffers, or a mark with none."""

    node: int
    step: int
    lr: float
    payload: Sequence[Any]
    waiter: Any
    mark: str | None = None  # "zero" or "nonfinite": no values ("dropped": internal)
    what: str = ""  # a nonfinite mark's tensor
    generation: int = 0  # the membership generation its worker divided by


@dataclass
class Step:
    """The sum of one step of one key while its pushes arrive."""

    total: torch.Tensor | None = None
    payloads: list[torch.Tensor] = field(default_factory=list)  # checked, summed at the end
    held: dict[int, Push] = field(default_factory=dict)  # arrived, not added yet
    nodes: tuple[int, ...] = ()  # whose pushes make the step, in the order they are added
    summed: int = 0  # the pushes of nodes[:summed] are in total
    waiters: list[Any] = field(default_factory=list)
    lr: float = 0.0
    first_lr: tuple[int, float] | None = None  # (node, lr) of the first push to arrive
    first_push_ns: int = 0  # when traced (bps.common.trace): the first push's arrival
    busy_ns: int = 0  # spent decoding and adding this step's pushes
    nonfinite: tuple[int, str] | None = None  # (node, what) of the first nonfinite mark
    oldest: int | None = None  # the oldest membership generation among its pushes
    dropped: bool = False  # a membership change: answered with a skip, nothing summed

    def pushed(self, node: int) -> bool:
        """Whether ``node``'s push of this step arrived (added, or held)."""
        return node in self.held or node in self.nodes[:self.summed]

    def started(self) -> bool:
        """Whether any push of this step arrived."""
        return self.summed > 0 or bool(self.held)

    def has_values(self) -> bool:
        """Whether a push with values (not a mark) was added."""
        return self.total is not None or bool(self.payloads)


@dataclass(slots=True)
class Finished:
    """A step's answer to each of its ``waiters``: ``payload`` (the server chain's bytes,
    or the raw sum in the key's dtype) with the ``skip`` fields where the step is
    skipped, or ``error`` where the server chain failed on the sum."""

    key: int
    step: int
    waiters: list[Any]
    payload: torch.Tensor | None
    skip: dict = field(default_factory=dict)
    server_s: float = 0.0  # seconds the step took to decode, sum and re-encode
    error: str | None = None


@dataclass(slots=True)
class Pushed:
    """What a push led to: ``refused``, (waiter, message) of an earlier push held for
    this one that could not be decoded once its turn came (its node must push again);
    ``finished``, the steps it completed, in step order."""

    refused: list[tuple[Any, str]] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)


@dataclass
class KeyState:
    """One key's declaration, server chain, steps in progress and last answer."""

    key: int
    numel: int
    dtype: torch.dtype
    params: dict | None
    name: str
    node: int  # the worker node that declared it first
    chain: Any
    steps: dict[int, Step] = field(default_factory=dict)
    last_step: int = -1
    last_payload: torch.Tensor | None = None
    last_skip: dict | None = None  # the skip fields of the last step's DATA, if skipped
    committed_step: int = -1  # the step the chain compressed last (ABORT can undo it)
    last_server_s: float = 0.0  # seconds the last step took to decode, sum and re-encode
    scratch: torch.Tensor | None = None  # a push widened for the sum, reused every step
    decoded: torch.Tensor | None = None  # a compressed push decoded for the sum, reused
    joined: torch.Tensor | None = None  # a raw push in several buffers joined, reused
    spare: list[torch.Tensor] = field(default_factory=list)  # sums of finished steps
    state_blob: bytes | None = None  # GET_STATE's answer until the state changes
    restored_step: int = -1  # a step whose answer a worker restored (Aggregator.restore)

    @property
    def where(self) -> str:
        return f"key {self.key} ({self.name!r})"

    def sums_at_the_end(self) -> bool:
        """Compressed pushes are checked as they arrive and summed in the server chain's
        error feedback pass once the last one is in (``compress_sum``: one pass where
        decoding, adding and correcting take three)."""
        return self.chain is not None and getattr(self.chain, "sums_payloads", False)

    def sums_in_place(self) -> bool:
        """Compressed pushes are summed in the key's own dtype (decoded into a reused
        buffer, then added with ``decompress_add``)."""
        return self.chain is not None and self.accumulate_dtype(2 ** 31) == self.dtype

    def join_buffer(self) -> torch.Tensor:
        """Where a raw push that came in several buffers is joined to be added (reused)."""
        if self.joined is None:
            self.joined = torch.empty(self.numel, dtype=self.dtype)
        return self.joined

    def spare_sum(self) -> torch.Tensor:
        """A buffer for a step's sum: one a finished step gave back, or a new one (a new
        tensor every step would cost a page fault per 4 KiB)."""
        return self.spare.pop() if self.spare else torch.empty(self.numel, dtype=self.dtype)

    def accumulate_dtype(self, terms: int) -> torch.dtype:
        """float32 (float64 for float64 keys); with at most two terms the key's own dtype,
        which is exact: float16/bfloat16 addition computes in float32 and rounds once,
        just as a float32 sum rounded at the end does."""
        if terms <= 2:
            return self.dtype
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def describe(self) -> str:
        return (f"numel={self.numel}, dtype={dtype_name(self.dtype)}, "
                f"params={self.params}")


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a payload still refers to the sum it was compressed from (a registered
    compressor may return a view of its input)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def add_in_chunks(total: torch.Tensor, values: torch.Tensor,
                  scratch: torch.Tensor | None = None) -> None:
    """``total += values`` (widened into ``scratch`` first where given), a large tensor in
    chunks on several threads (torch releases the GIL; the server runs torch on one
    thread). Elementwise, so the result is the same bits as one ``add_``.

        >>> total = torch.ones(3)
        >>> add_in_chunks(total, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16),
        ...               torch.empty(3)); total.tolist()
        [2.0, 3.0, 4.0]
    """
    def add(lo: int, hi: int) -> None:
        part = values[lo:hi] if scratch is None else scratch[lo:hi].copy_(values[lo:hi])
        total[lo:hi].add_(part)

    run_chunks(add, chunk_bounds(total.numel()))


def payload_data(payload: Sequence[Any]) -> torch.Tensor:
    """A compressed push's bytes: a view of its buffer, or its buffers joined. Viewed
    through numpy: ``torch.frombuffer`` lets go of the GIL, and taking it back waits for
    the other threads' Python (bench/key_overhead.py --convoy); an empty buffer goes to
    it, which refuses it."""
    if len(payload) > 1:
        return torch.from_numpy(join_frames(payload))
    if not len(payload[0]):
        return torch.frombuffer(payload[0], dtype=torch.uint8)
    return torch.from_numpy(np.frombuffer(payload[0], dtype=np.uint8))


class Aggregator:
    """The keys of one server engine, each summing its steps' pushes of ``workers`` worker
    nodes. ``tracer`` (a ``bps.common.trace.Tracer``, or None) records pushes, decodes,
    sums and re-encodes of the traced steps.

    A push's buffers are the aggregator's from then on: a raw key's first push of a step
    may become that step's sum, added to in place (so they must be writable).
    """

    def __init__(self, workers: int, tracer: Any = None) -> None:
        self.workers = workers
        self.tracer = tracer
        self.keys: dict[int, KeyState] = {}
        self.members: tuple[int, ...] = tuple(range(workers))
        self.generation = 0
        self.left: dict[int, int] = {}  # a node that left -> the generation it left at
        self.joined: dict[int, int] = {}  # a node that joined -> the generation it joined at

    def key(self, key: int) -> KeyState:
        """The state of a declared key; RequestError where it is not."""
        state = self.keys.get(key)
        if state is None:
            raise RequestError(f"key {key}: unknown key (not declared)")
        return state

    def register(self, key: int, numel: int, dtype: torch.dtype, params: dict | None,
                 name: str, node: int) -> KeyState:
        """Declare a key (again: it must be declared the same way) and build its server
        chain ``build(params, numel, dtype, role="server")``."""
        existing = self.keys.get(key)
        if existing is not None:
            if (existing.numel, existing.dtype, existing.params) != (numel, dtype, params):
                probe = KeyState(key, numel, dtype, params, name, node, None)
                raise RequestError(
                    f"key {key} declared differently by worker nodes: worker {node} "
                    f"declared {name!r} with {probe.describe()}, but worker {existing.node} "
                    f"declared {existing.name!r} with {existing.describe()}")
            return existing
        chain = None
        if params is not None:
            from bps.compressors import build

            try:
                chain = build(params, numel, dtype, role="server")
            except (TypeError, ValueError) as exc:
                raise RequestError(f"key {key} ({name!r}): {exc}") from None
        state = self.keys[key] = KeyState(key, numel, dtype, params, name, node, chain)
        return state

    # ---- pushes ------------------------------------------------------------------------

    def push(self, key: int, node: int, step: int, payload: Sequence[Any], lr: float,
             waiter: Any, mark: str | None = None, what: str = "",
             generation: int = 0) -> Pushed:
        """Worker ``node``'s push of ``step``: added to the step's sum, or held until the
        lower-numbered nodes' are; ``waiter`` is among the step's :class:`Finished`
        waiters. A mark (``"zero"``, ``"nonfinite"``) carries no payload. ``generation``:
        the membership its worker divided by (an older one than this aggregator's drops
        the step). Raises RequestError, with nothing added, where the push is refused."""
        state = self.key(key)
        if not 0 <= node < self.workers:
            raise RequestError(f"{state.where}: field 'node'={node} out of range")
        if step == state.last_step == state.restored_step:  # it missed the answer: again
            return Pushed(finished=[self._answer(state, step, [waiter])])
        if node in self.left:
            raise RequestError(f"{state.where}: push of step {step} refused: worker {node} "
                               f"left the job at membership generation {self.left[node]} "
                               f"(now {self.generation}, members {list(self.members)})")
        # a marker carries no gradient, so its learning rate is not the step's (a joined
        # worker's optimizer no longer steps)
        pending = state.steps.get(step)
        drop = generation < self.generation
        checked_lr = None if mark is not None or drop or (pending is not None
                                                          and pending.dropped) else float(lr)
        self._check_push(state, pending, node, step, checked_lr)
        if pending is None:
            pending = state.steps[step] = Step(nodes=self.members)
        if drop and not pending.dropped:
            self._drop(state, pending, generation if pending.oldest is None
                       else min(pending.oldest, generation))
        if pending.first_lr is None and checked_lr is not None:
            pending.first_lr = (node, checked_lr)
        tracer = self.tracer
        if tracer is not None and tracer.at(step):
            pending.first_push_ns = pending.first_push_ns or time.monotonic_ns()
            tracer.instant("push", state.name, step, node=node)
        if pending.dropped:  # nothing of it is summed
            payload, mark = (), "dropped"
        pending.oldest = generation if pending.oldest is None else min(pending.oldest,
                                                                       generation)
        pending.held[node] = Push(node, step, float(lr), payload, waiter, mark, what,
                                  generation)
        pending.waiters.append(waiter)
        refused = self._sum_held(state, pending)
        if not pending.started() and not pending.waiters:  # a refused push holds no slot
            del state.steps[step]
        pushed = Pushed()
        if refused is not None:
            push, error = refused
            if push.node == node:
                raise error
            pushed.refused.append((push.waiter, str(error)))
        pushed.finished = self._finish_ready_steps(state)
        return pushed

    def _check_step(self, state: KeyState, step: int) -> None:
        if step <= state.last_step:
            raise RequestError(f"{state.where}: step {step} already completed (last "
                               f"completed step {state.last_step})")
        if step not in state.steps and len(state.steps) >= MAX_PENDING_STEPS:
            raise RequestError(f"{state.where}: step {step} is too far ahead: "
                               f"{MAX_PENDING_STEPS} steps already pending")

    def _check_push(self, state: KeyState, pending: Step | None, node: int, step: int,
                    lr: float | None) -> None:
        """A push of ``step`` by worker ``node`` is neither stale nor a repeat, the node
        has no other push of this key waiting, the step is within STEP_WINDOW of the
        other pending pushes' steps, and its learning rate (``None``: a marker's, not
        checked) is that of the step's first push with values."""
        self._check_step(state, step)
        if pending is not None and pending.pushed(node):
            raise RequestError(f"{state.where}: worker {node} pushed step {step} twice")
        for other, waiting in state.steps.items():
            if other == step or not waiting.started():
                continue
            if waiting.pushed(node):
                raise RequestError(f"{state.where}: worker {node} pushed step {step} while its "
                                   f"push of step {other} still waits for the other workers")
            if abs(step - other) > STEP_WINDOW:
                raise RequestError(f"{state.where}: step {step} is more than {STEP_WINDOW} step "
                                   f"away from step {other}, which other workers pushed")
        if (lr is not None and pending is not None and pending.first_lr is not None
                and pending.first_lr[1] != lr):
            first_node, first_lr = pending.first_lr
            raise RequestError(f"{state.where} step {step}: worker {node} pushed learning rate "
                               f"{lr!r}, but worker {first_node} pushed {first_lr!r} for the "
                               f"same step (the workers' learning rates differ)")

    def set_members(self, generation: int, members: Sequence[int]) -> Pushed:
        """A new membership (the scheduler's MEMBERSHIP): worker nodes ``members`` from
        ``generation`` on. Every step in progress that holds a push of an older generation
        is dropped; the others wait for the present members only. Returns what that
        finished (steps whose last missing push was a departed node's) and refused (a
        held push that could not be decoded once its turn came). An older or repeated
        generation changes nothing."""
        pushed = Pushed()
        if generation <= self.generation:
            return pushed
        present = tuple(sorted(set(members)))
        for node in self.members:
            if node not in present:
                self.left[node] = generation
        for node in present:
            if node not in self.members:  # a node joins (again): its pushes count from now
                self.left.pop(node, None)
                self.joined[node] = generation
        self.generation, self.members = generation, present
        for state in self.keys.values():
            for pending in state.steps.values():
                if pending.dropped or (pending.oldest is not None
                                       and pending.oldest < generation):
                    self._drop(state, pending, pending.oldest)
                else:  # no push of a departed node is in it (it never had this generation)
                    pending.nodes = tuple(n for n in pending.nodes if n in present)
                refused = self._sum_held(state, pending)
                if refused is not None:
                    push, error = refused
                    pushed.refused.append((push.waiter, str(error)))
            pushed.finished += self._finish_ready_steps(state)
        return pushed

    def _drop(self, state: KeyState, pending: Step, oldest: int | None) -> None:
        """Drop a step in progress (a membership change): its sum so far is discarded, and
        it waits for every present member's push, to be answered with a skip; a node that
        joined after ``oldest`` (the oldest generation among its pushes) never pushes it
        (it starts with the step after) and is not waited for."""
        arrived = {*pending.nodes[:pending.summed], *pending.held}
        self._release(state, pending)
        pending.total, pending.payloads, pending.nonfinite = None, [], None
        pending.first_lr, pending.dropped, pending.summed = None, True, 0
        oldest = self.generation if oldest is None else oldest
        pending.nodes = tuple(n for n in self.members if self.joined.get(n, 0) <= oldest)
        pending.held = {n: Push(n, 0, 0.0, (), None, "dropped") for n in sorted(arrived)
                        if n in self.members}

    def _sum_held(self, state: KeyState, pending: Step) -> tuple[Push, RequestError] | None:
        """Add the held pushes to the sum in node order, as far as every lower-numbered
        node has pushed. A push that cannot be decoded is dropped (the nodes after it
        wait for that node to push again) and returned with its error."""
        nodes = pending.nodes
        while pending.summed < len(nodes) and nodes[pending.summed] in pending.held:
            push = pending.held.pop(nodes[pending.summed])
            try:
                self._add_push(state, pending, push)
            except RequestError as exc:
                pending.waiters.remove(push.waiter)
                return push, exc
            pending.summed += 1
        return None

    def _add_push(self, state: KeyState, pending: Step, push: Push) -> None:
        """Decode a push and add it to the step's sum; the time goes to ``busy_ns``."""
        start_ns = time.monotonic_ns()
        self._add_values(state, pending, push)
        end_ns = time.monotonic_ns()
        pending.busy_ns += end_ns - start_ns
        if self.tracer is not None and pending.first_push_ns:
            self.tracer.complete("decode", state.name, push.step, start_ns, end_ns,
                                 node=push.node)

    def _add_values(self, state: KeyState, pending: Step, push: Push) -> None:
        node, payload = push.node, push.payload
        if push.mark is not None:  # nothing to add
            if push.mark == "nonfinite" and pending.nonfinite is None:
                pending.nonfinite = (node, push.what)
            return
        if state.sums_at_the_end():
            data = payload_data(payload)
            try:
                state.chain.check_payload(data)
            except ValueError as exc:
                raise RequestError(f"{state.where}: cannot decode payload from worker "
                                   f"{node}: {exc}") from None
            if not pending.payloads:
                pending.lr = push.lr
            pending.payloads.append(data)
            return
        if pending.total is not None and state.sums_in_place():
            # a compressed push adds into the sum directly (a sparse payload touches only
            # its k elements); it is decoded before anything is added
            self._decode(state, payload, node, add_to=pending.total)
            return
        if state.chain is None and len(payload) > 1 and pending.total is not None \
                and pending.total.dtype == state.dtype \
                and self._add_buffers(state, payload, node, pending.total):
            return
        # the step's first push becomes its sum: a compressed one is decoded into a reused
        # buffer, a raw one is the buffer itself (or its widened copy; a raw push in
        # several buffers is joined into a new buffer that becomes the sum, or into the
        # key's reused one where it is widened, or added with buffers that cut elements)
        out = state.spare_sum() if state.sums_in_place() else None
        if state.chain is None and len(payload) > 1 and (
                pending.total is not None
                or state.accumulate_dtype(len(pending.nodes)) != state.dtype):
            out = state.join_buffer()
        try:
            values = self._decode(state, payload, node, out)
        except RequestError:
            if out is not None and state.sums_in_place():  # not the raw key's join buffer
                state.spare.append(out)
            raise
        if pending.total is None:
            pending.total = values.to(state.accumulate_dtype(len(pending.nodes)))
            pending.lr = push.lr
        elif values.dtype == pending.total.dtype:
            add_in_chunks(pending.total, values)
        else:  # widen first: torch's mixed-dtype add_ is ~4x slower than copy + add_
            if state.scratch is None:
                state.scratch = torch.empty(state.numel, dtype=pending.total.dtype)
            add_in_chunks(pending.total, values, state.scratch)

    def _decode(self, state: KeyState, payload: Sequence[Any], node: int,
                out: torch.Tensor | None = None, add_to: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The push's values: a view of its buffer (raw keys; a payload in several
        buffers is joined into ``out``, a new tensor if None), or decoded into ``out`` (a
        new tensor if None), or with ``add_to``: decoded and added to it in place. Values
        that are inf or NaN are refused before anything is added."""
        if state.chain is None:
            if not state.numel:
                values = torch.zeros(0, dtype=state.dtype)
            elif len(payload) == 1:
                values = torch.frombuffer(payload[0], dtype=state.dtype)
                finite = tensor_finite(values)
            else:  # joined and checked in one pass
                values = torch.empty(state.numel, dtype=state.dtype) if out is None else out
                finite = join_finite(list(payload), values)
            if not finite:
                raise _nonfinite_push(state, node)
            return values
        data = payload_data(payload)
        try:
            if add_to is not None:
                if state.decoded is None:
                    state.decoded = torch.empty(state.numel, dtype=state.dtype)
                values = state.chain.decompress_add(data, add_to, state.decoded)
            else:
                values = state.chain.decompress(data, out)
        except Exception as exc:
            raise RequestError(f"{state.where}: cannot decode payload from worker {node}: "
                               f"{type(exc).__name__}: {exc}") from None
        if values.numel() != state.numel:
            raise RequestError(f"{state.where}: payload decodes to {values.numel()} values, "
                               f"expected {state.numel}")
        return values

    @staticmethod
    def _add_buffers(state: KeyState, payload: Sequence[Any], node: int,
                     total: torch.Tensor) -> bool:
        """Add a raw push of several buffers to ``total`` (of the key's dtype) where each
        lies, with no join; every buffer is checked before anything is added. False,
        with nothing done, where a buffer does not hold whole elements (it is joined)."""
        finite = frames_finite(list(payload), state.dtype)
        if finite is None:
            return False
        if not finite:
            raise _nonfinite_push(state, node)
        start = 0
        for buffer in filter(len, payload):
            part = torch.frombuffer(buffer, dtype=state.dtype)
            total[start:start + part.numel()].add_(part)
            start += part.numel()
        return True

    # ---- finished steps ----------------------------------------------------------------

    def pull(self, key: int, step: int, waiter: Any) -> Finished | None:
        """The answer of ``step`` where it is the last one finished; else ``waiter`` joins
        the waiters of a step in progress or of the next one (None)."""
        state = self.key(key)
        if step == state.last_step and state.last_payload is not None:
            return self._answer(state, step, [waiter])
        self._check_step(state, step)
        pending = state.steps.get(step)
        if (pending is None or not pending.started()) and step != state.last_step + 1:
            # only a step in progress or the next one: PULLs cannot park future steps
            raise RequestError(f"{state.where}: PULL of step {step}, which nobody pushed "
                               f"(last completed step {state.last_step})")
        state.steps.setdefault(step, Step(nodes=self.members)).waiters.append(waiter)
        return None

    def _finish_ready_steps(self, state: KeyState) -> list[Finished]:
        finished = []
        while state.steps:
            step = min(state.steps)
            pending = state.steps[step]
            if pending.summed < len(pending.nodes):
                break
            del state.steps[step]
            state.last_step = step
            state.last_server_s = pending.busy_ns / 1e9
            finished.append(self._finish(state, step, pending))
        return finished

    def _finish(self, state: KeyState, step: int, pending: Step) -> Finished:
        """The answer of a step every node pushed: its sum, compressed by the server
        chain, or a skip, or the chain's error."""
        if pending.dropped:
            self._release(state, pending)
            state.last_payload = torch.zeros(0, dtype=torch.uint8)
            state.last_skip = {"skip": "membership", "skip_node": -1, "skip_what": "",
                               "generation": self.generation, "members": list(self.members)}
            return self._answer(state, step, pending.waiters)
        if pending.nonfinite is not None or not pending.has_values():
            return self._skip(state, step, pending)
        summed_ns = time.monotonic_ns()
        total = None if pending.payloads else pending.total.to(state.dtype)
        if state.chain is None and state.dtype == torch.float16 and not tensor_finite(total):
            # finite pushes whose sum overflows float16: skipped like an inf pushed
            pending.nonfinite = (-1, state.name)
            return self._skip(state, step, pending)
        if state.chain is not None:
            try:
                total = self._compress(state, pending, total)
            except NonFiniteError:  # finite pushes whose sum (with the error) overflows
                pending.nonfinite = (-1, state.name)
                return self._skip(state, step, pending)
            except Exception as exc:  # every waiter hears of it, not only the last pusher
                return self._fail_step(state, step, pending, exc)
            state.committed_step = step
        encoded_ns = time.monotonic_ns()
        state.last_server_s += (encoded_ns - summed_ns) / 1e9
        tracer = self.tracer
        if tracer is not None and pending.first_push_ns:
            tracer.complete("sum", state.name, step, pending.first_push_ns, summed_ns,
                            server_s=state.last_server_s)
            if state.chain is not None:
                tracer.complete("compress", state.name, step, summed_ns, encoded_ns,
                                bytes=total.numel() * total.element_size())
        state.last_payload, state.last_skip = total, None
        state.state_blob = None
        return self._answer(state, step, pending.waiters)

    def _compress(self, state: KeyState, pending: Step, total: torch.Tensor | None
                  ) -> torch.Tensor:
        """The server chain's payload of the step's sum (``total``, or the checked
        ``pending.payloads`` where the chain sums them itself). Raises what the chain
        raised (NonFiniteError, ...), its learning rate as before."""
        chain = state.chain
        if pending.lr > 0:
            chain.set_lr(pending.lr)
        try:
            if pending.payloads:
                return chain.compress_sum(pending.payloads)
            payload = chain.compress(total)
        except Exception:
            chain.cancel()
            raise
        if state.sums_in_place() and not shares_memory(total, payload):
            state.spare.append(total)
        return payload

    def _fail_step(self, state: KeyState, step: int, pending: Step, exc: Exception
                   ) -> Finished:
        """The server chain failed on the step's sum: an error to every push and PULL of
        the step, which no later PULL can fetch either."""
        msg = error_text(f"{state.where} step {step}: the server chain failed on the sum: "
                         f"{type(exc).__name__}: {exc}")
        log.error(msg)
        self._release(state, pending)
        state.last_payload, state.last_skip, state.state_blob = None, None, None
        return Finished(state.key, step, pending.waiters, None, error=msg)

    @staticmethod
    def _release(state: KeyState, pending: Step) -> None:
        """Give a step's sum buffer back to the key, where it owns one."""
        if pending.total is not None and state.sums_in_place():
            state.spare.append(pending.total)

    def _skip(self, state: KeyState, step: int, pending: Step) -> Finished:
        """Answer a step that is not summed: a non-finite mark, or only zero marks."""
        self._release(state, pending)
        node, what = pending.nonfinite if pending.nonfinite is not None else (-1, "")
        state.last_payload = torch.zeros(0, dtype=torch.uint8)
        state.last_skip = {"skip": "nonfinite" if pending.nonfinite else "zero",
                           "skip_node": node, "skip_what": what}
        return self._answer(state, step, pending.waiters)

    @staticmethod
    def _answer(state: KeyState, step: int, waiters: list[Any]) -> Finished:
        return Finished(state.key, step, waiters, state.last_payload,
                        dict(state.last_skip or {}), state.last_server_s)

    # ---- the server chain's state ------------------------------------------------------

    def get_state(self, key: int) -> tuple[int, bytes]:
        """(the last finished step, the server chain's state on the wire: msgpack of
        ``state_to_wire(chain.state_dict())``, ``{}`` for a raw key)."""
        state = self.key(key)
        if state.state_blob is None:  # every GET_STATE until the next step shares it
            from bps.compressors import state_to_wire

            sd = {} if state.chain is None else state.chain.state_dict()
            state.state_blob = msgpack.packb(state_to_wire(sd), use_bin_type=True)
        return state.last_step, state.state_blob

    def set_state(self, key: int, payload: Sequence[Any]) -> None:
        """Load a server chain's state (what :meth:`get_state` gave, in buffers) and
        start over from step 0; refused while a step is in progress."""
        state = self.key(key)
        if any(s.started() for s in state.steps.values()):
            raise RequestError(f"{state.where}: SET_STATE while a step is in progress")
        if state.chain is not None:
            from bps.compressors import state_from_wire

            try:
                sd = state_from_wire(msgpack.unpackb(join_frames(payload), raw=False,
                                                     strict_map_key=False))
                state.chain.load_state_dict(sd)
            except Exception as exc:
                raise RequestError(f"{state.where}: bad state: {type(exc).__name__}: "
                                   f"{exc}") from None
        state.steps.clear()
        state.last_step, state.last_payload, state.last_skip = -1, None, None
        state.committed_step = -1
        state.last_server_s = 0.0
        state.state_blob = None

    def restore(self, key: int, step: int, payload: Sequence[Any], skip: dict | None
                ) -> list[Finished]:
        """The answer of ``step`` (``payload``'s bytes, or the ``skip`` fields) that a
        worker got from the server this one replaced: where it is later than every step
        this key finished, it becomes the key's last answer, and the step of that number
        in progress (a worker that missed the answer pushed it again) is answered with
        it; a later push of that step too. Returns the steps that finished."""
        state = self.key(key)
        if step <= state.last_step:
            return []
        finished = []
        for number in sorted(s for s in state.steps if s <= step):
            pending = state.steps.pop(number)
            self._release(state, pending)
            if number == step:
                finished.append(pending)
        state.last_step, state.restored_step = step, step
        state.last_payload = torch.from_numpy(join_frames(payload))  # a copy of its own
        state.last_skip = dict(skip) if skip is not None else None
        state.committed_step, state.state_blob = -1, None
        return [self._answer(state, step, pending.waiters) for pending in finished]

    def abort(self, key: int, step: int) -> None:
        """Undo the server chain's compression of ``step`` where it was the last (a step
        the workers skip as a whole); nothing otherwise."""
        state = self.key(key)
        if state.chain is not None and state.committed_step == step:
            state.chain.rollback()
            state.committed_step = -1
            state.state_blob = None


def _nonfinite_push(state: KeyState, node: int) -> RequestError:
    return RequestError(f"{state.where}: the push of worker {node} has inf or NaN values")
