"""What the worker engine has in flight: keys, requests, and the per-server send queues.

A push waits in its server's queue, ordered by (step, -priority, arrival), until that
server has fewer than ``BPS_MAX_INFLIGHT`` pushes not yet acknowledged::

    queues = SendQueues(num_servers=1, credit=1)
    queues.put(0, order_a, item_a); queues.take()   # -> [item_a]; the credit is used
    queues.put(0, order_b, item_b); queues.put(0, order_c, item_c)
    queues.release(0); queues.take()                # -> the item of min(order_b, order_c)
"""

from __future__ import annotations

import concurrent.futures
import heapq
from dataclasses import dataclass, field
from typing import Any

import torch

from bps.common.protocol import Op
from bps.common.trace import Tracer


@dataclass
class KeyInfo:
    """A declared key: its shape, its server and (compressed keys) its worker chain."""

    key: int
    numel: int
    dtype: torch.dtype
    name: str
    server: int
    chain: Any
    busy: bool = False
    out: torch.Tensor | None = None  # where the in-flight push_pull decodes its aggregate
    compressed_step: int = -1  # the last step the chain compressed (rollback undoes it)
    staging: Any = None  # the device path: a worker.device_path.KeyStaging
    generation: int = 0  # the membership generation the push in flight carries


@dataclass(frozen=True)
class Skipped:
    """What a push_pull's future gives where the server did not sum its step:
    ``reason`` ``"nonfinite"`` (worker node ``node`` marked ``what`` as inf/NaN),
    ``"zero"`` (every node pushed a zero marker) or ``"membership"`` (worker nodes left:
    ``members`` are present from membership ``generation`` on); ``key`` names the key."""

    reason: str
    node: int
    what: str
    key: str
    generation: int = 0
    members: tuple[int, ...] = ()


@dataclass
class Request:
    """A message to a server and the future its reply settles; a push waits in its
    server's queue by ``order``."""

    order: tuple
    rid: int = field(compare=False)
    op: Op = field(compare=False)
    server: int = field(compare=False)
    fields: dict = field(compare=False)
    payload: Any = field(compare=False)
    future: concurrent.futures.Future = field(compare=False)
    what: str = field(compare=False)
    info: KeyInfo | None = field(compare=False, default=None)
    deadline: float = field(compare=False, default=0.0)
    acked: bool = field(compare=False, default=False)
    # monotonic_ns of its stages, for the timeline (bps.common.trace)
    queued_ns: int = field(compare=False, default=0)
    sent_ns: int = field(compare=False, default=0)
    acked_ns: int = field(compare=False, default=0)


def new_future() -> concurrent.futures.Future:
    """A running future: not cancellable, the engine resolves it."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


def settle(info: KeyInfo | None, future: concurrent.futures.Future, result: Any = None,
           error: BaseException | None = None) -> None:
    """Resolve a future, first freeing its key for the next push_pull."""
    if info is not None:
        info.busy = False
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def info_label(info: KeyInfo) -> str:
    """``key 3 ('fc.weight[0]')``: how errors name a key."""
    return f"key {info.key} ({info.name!r})" if info.name else f"key {info.key}"


def trace_stage(tracer: Tracer | None, kind: str, request: Request, start_ns: int,
                end_ns: int, **args: object) -> None:
    """A stage of a push_pull on the timeline (pushes only; no-op without a tracer)."""
    if tracer is not None and request.op == Op.PUSH and start_ns:
        tracer.complete(kind, request.info.name, request.fields["step"], start_ns, end_ns,
                        **args)


def send_order(step: int, priority: int, seq: int) -> tuple[int, int, int]:
    """Sort key of waiting pushes: earlier steps, then larger priority, then arrival."""
    return (step, -priority, seq)


class SendQueues:
    """Per-server queues of pushes waiting for send credit; not thread-safe (the engine
    holds its lock). ``take`` hands out, per server, the waiting items of smallest
    ``order`` while fewer than ``credit`` are unacknowledged; ``release`` returns a credit.
    """

    def __init__(self, num_servers: int, credit: int) -> None:
        self.credit = credit
        self.heaps: list[list] = [[] for _ in range(num_servers)]
        self.unacked = [0] * num_servers

    def put(self, server: int, order: tuple, item: Any) -> None:
        """Queue ``item`` for ``server`` by ``order`` (unique: :func:`send_order`'s
        arrival number makes it so; the heap compares tuples, never items)."""
        heapq.heappush(self.heaps[server], (order, item))

    def take(self) -> list:
        ready = []
        for server, heap in enumerate(self.heaps):
            while heap and self.unacked[server] < self.credit:
                ready.append(heapq.heappop(heap)[1])
                self.unacked[server] += 1
        return ready

    @property
    def waiting(self) -> bool:
        """Whether any item waits (read without the lock, it may be stale: a hint)."""
        return any(self.heaps)

    def release(self, server: int) -> None:
        self.unacked[server] -= 1

    def clear(self) -> list:
        items = [item for heap in self.heaps for _, item in heap]
        for heap in self.heaps:
            heap.clear()
        return items
