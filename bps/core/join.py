"""Uneven inputs (DDP's ``Join``): ``with trainer.join(): ...``.

A worker whose loop inside the block ends joins: it takes part in the steps the others
still run with a zero contribution, until every worker has joined. The divisor stays
the number of workers (``bps.size()``), as DDP's ``divide_by_initial_world_size``.
Then every worker takes the parameters and buffers of the one that stepped last (the
lowest node among them), so all leave with the same model. Each step a raw key of one
float32 per worker node sums which nodes still have data; with several local ranks a
channel in the node tells which local ranks do, and the chain learning rates of the
lowest of them, which a joined local rank 0 pushes with.

Example::

    >>> with trainer.join():
    ...     for x, y in my_shard:           # shards of different lengths
    ...         trainer.zero_grad()
    ...         loss_fn(model(x), y).backward()
    ...         trainer.step()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from bps.core.frontend import FrontEndCore, NonFiniteGradientError
from bps.core.model_sync import broadcast_model, broadcast_model_in_node

log = logging.getLogger("bps")


class UnevenInputs:
    """The join state of a synchronous trainer (see the module's docstring)."""

    def __init__(self, core: FrontEndCore) -> None:
        self.core = core
        rt = core.runtime
        # declared always: every worker declares the same keys
        self.key = rt.allocate_keys(1)
        if rt.engine is not None:
            rt.engine.declare(self.key, rt.engine.num_workers, torch.float32, None,
                              name="join")
        self.joining = False  # inside join(): each step counts the nodes with data
        self.joined = False  # this worker ran out of data: it pushes zero markers
        self.future: concurrent.futures.Future | None = None
        self.active: list[int] = []  # the nodes with data this step
        self.last_active = 0  # the lowest of them in the last step any node had data
        # several local ranks: which have data this step (1.0 each), the chain learning
        # rates of the lowest of them (None: none has), that rank in the last step the
        # node had any, and the channel that tells them apart
        self.local_active: torch.Tensor | None = None
        self.node_lrs: list[float] | None = None
        self.last_local_active = 0
        self.channel = None

    def node_joined(self) -> bool:
        """Whether this node pushes a zero marker: this worker joined, or (several local
        ranks) every local rank of the node has."""
        if self.joining and self.core.runtime.local_size > 1:
            return not bool(self.node_active().any())
        return self.joined

    def node_active(self) -> torch.Tensor:
        """Which local ranks of this node still have data this step (1.0 each), agreed
        at the step's first push on every local rank (a joined rank's first push comes
        from synchronize())."""
        if self.local_active is None:
            rt, groups = self.core.runtime, len(self.core.optimizer.param_groups)
            rows = torch.zeros(rt.local_size, 1 + groups, dtype=torch.float64)
            if not self.joined:
                rows[rt.local_rank, 0] = 1.0
                rows[rt.local_rank, 1:] = torch.tensor(
                    [self.core.own_chain_lr(g) for g in range(groups)], dtype=torch.float64)
            self.channel.reduce(rows)
            self.channel.broadcast(rows)
            self.local_active = rows[:, 0]
            self.node_lrs = None
            if self.local_active.any():
                first = int(self.local_active.nonzero()[0])
                self.node_lrs = rows[first, 1:].tolist()
                self.last_local_active = first
        return self.local_active

    def chain_lr(self, group: int) -> float:
        """A joined rank runs no loop that sets its learning rate: the node's first rank
        with data gives it."""
        if self.joined and self.node_lrs is not None:
            return self.node_lrs[group]
        return self.core.own_chain_lr(group)

    def push_flag(self, wire_step: int) -> None:
        """In join(): push this node's count of ranks with data (synchronize())."""
        rt = self.core.runtime
        if not self.joining or rt.engine is None:
            return
        flag = torch.zeros(rt.engine.num_workers, dtype=torch.float32)
        flag[rt.node_id] = float(self.node_active().sum()) if rt.local_size > 1 \
            else float(not self.joined)
        self.future = rt.engine.push_pull(self.key, flag, wire_step, 0.0)

    def count_active(self) -> None:
        """In join(), once the step's aggregates are in: which nodes had data."""
        if not self.joining:
            return
        rt = self.core.runtime
        counts = torch.zeros(rt.num_nodes, dtype=torch.float32)
        if self.future is not None:
            counts = self.future.result(timeout=rt.env.timeout * 2)
            self.future = None
            if not isinstance(counts, torch.Tensor):  # a step dropped (worker nodes left)
                counts = torch.zeros(rt.num_nodes, dtype=torch.float32)
                counts[self.active] = 1.0  # as in the step before
        if rt.local_size > 1:  # local rank 0's counts, to its node
            self.channel.broadcast(counts)
        self.active = [node for node, c in enumerate(counts.tolist()) if c]
        if self.active:
            self.last_active = self.active[0]

    def end_step(self) -> None:
        self.local_active = None

    @contextlib.contextmanager
    def run(self, step: Callable[[], bool]) -> Iterator[None]:
        """The body of ``trainer.join()``: after the block, ``step()`` until every worker
        has joined, then the freshest model to everyone."""
        rt = self.core.runtime
        if rt.local_size > 1 and self.channel is None:  # every local rank is here
            self.channel = rt.group.channel(rt.unique_name("join"))
        self.joining, self.active = True, []
        try:
            yield
            self.joined = True
            while True:
                try:
                    step()
                except NonFiniteGradientError as exc:  # every worker raised it: go on
                    log.warning("bps: while joined: %s", exc)
                if not self.active:
                    break
            if self.channel is not None:  # the node's freshest model to its local rank 0
                broadcast_model_in_node(self.channel, self.core.model, self.last_local_active)
            broadcast_model(rt, self.core.model, source=self.last_active)
        finally:
            self.joining = self.joined = False
