"""Intra-node reduction and broadcast between the local ranks of one worker node.

The local ranks of a node form their own torch.distributed process groups
(gloo for CPU tensors, NCCL for CUDA tensors), built directly on a TCPStore
served by local rank 0, so the user's default process group stays free (for
DDP, for example). Each :class:`LocalChannel` is an independent group: ops on
one channel are matched by issue order, so a channel must be driven by one
thread at a time; use one channel per thread.

Usage::

    from bps.worker.intranode import LocalGroup

    group = LocalGroup.connect(local_rank, local_size, "127.0.0.1", 29600, timeout_s=60)
    reduce_ch, bcast_ch = group.channel("reduce"), group.channel("broadcast")
    reduce_ch.reduce(grad)        # local rank 0 now holds the sum over the node
    bcast_ch.broadcast(grad)      # every local rank now holds local rank 0's tensor
    group.close()
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class IntraNodeError(RuntimeError):
    """A collective between the local ranks failed or timed out."""


class LocalChannel:
    """One ordered stream of collectives between the local ranks of a node."""

    def __init__(self, name: str, store: dist.Store, rank: int, size: int, timeout_s: float):
        self.name = name
        self.rank = rank
        self.size = size
        self._store = store
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._gloo = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{name}/gloo", store), rank, size, self._timeout
        )
        self._nccl = None

    def close(self) -> None:
        """Destroy this channel's process groups and its hold on the store now: left to
        the end of the interpreter, gloo's teardown aborts about every other process
        ("terminate called without an active exception", exit code 134)."""
        self._gloo = self._nccl = self._store = None

    def _backend(self, tensor: torch.Tensor):
        if self._gloo is None:
            raise IntraNodeError(f"intra-node channel {self.name!r} is closed (bps.shutdown())")
        if not tensor.is_cuda:
            return self._gloo
        if self._nccl is None:
            # NCCL for CUDA tensors: the node's GPUs talk over NVLink/PCIe directly.
            torch.cuda.set_device(tensor.device)
            opts = dist.ProcessGroupNCCL.Options()
            self._nccl = dist.ProcessGroupNCCL(
                dist.PrefixStore(f"{self.name}/nccl", self._store), self.rank, self.size, opts
            )
        return self._nccl

    def _wait(self, work, what: str, tensor: torch.Tensor) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as exc:
            raise IntraNodeError(
                f"intra-node {what} on channel {self.name!r} (local rank {self.rank} of "
                f"{self.size}, {tensor.numel()} x {tensor.dtype}) failed: {exc}"
            ) from exc

    def reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the local ranks into local rank 0's ``tensor`` (in place)."""
        if self.size == 1:
            return
        opts = dist.ReduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.rootRank = 0
        opts.rootTensor = 0
        self._wait(self._backend(tensor).reduce([tensor], opts), "reduce", tensor)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Overwrite ``tensor`` on every local rank with local rank ``root``'s ``tensor``."""
        if self.size == 1:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._wait(self._backend(tensor).broadcast([tensor], opts), "broadcast", tensor)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Local rank 0's ``data`` on every local rank (others pass ``None``)."""
        if self.size == 1:
            return data or b""
        length = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self.broadcast(length)
        buf = torch.zeros(int(length.item()), dtype=torch.uint8)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf)
        return bytes(buf.numpy().tobytes())

    def barrier(self) -> None:
        """Block until every local rank has reached this call (bounded by the timeout)."""
        self.broadcast(torch.zeros(1))


class LocalGroup:
    """The local ranks of one worker node, rendezvoused through a TCPStore on local rank 0."""

    def __init__(self, store: dist.Store | None, rank: int, size: int, timeout_s: float):
        self.rank = rank
        self.size = size
        self._store = store
        self._timeout_s = timeout_s
        self._channels: dict[str, LocalChannel] = {}

    @classmethod
    def connect(
        cls, local_rank: int, local_size: int, addr: str, port: int, timeout_s: float = 60.0
    ) -> LocalGroup:
        """Rendezvous with the other local ranks; a single local rank needs no store."""
        if local_size == 1:
            return cls(None, 0, 1, timeout_s)
        try:
            store = dist.TCPStore(
                addr,
                port,
                local_size,
                local_rank == 0,
                datetime.timedelta(seconds=timeout_s),
                wait_for_workers=True,
            )
        except (RuntimeError, OSError) as exc:
            raise IntraNodeError(
                f"local rank {local_rank} of {local_size} could not rendezvous with the "
                f"node's local rank 0 at {addr}:{port} within {timeout_s:g}s: {exc}"
            ) from exc
        return cls(store, local_rank, local_size, timeout_s)

    def channel(self, name: str) -> LocalChannel:
        """The channel called ``name`` (created on first use; every local rank must ask)."""
        if name not in self._channels:
            if self.size == 1:
                self._channels[name] = _SingleChannel(name)
            else:
                self._channels[name] = LocalChannel(
                    name, self._store, self.rank, self.size, self._timeout_s
                )
        return self._channels[name]

    def close(self, destroy: bool = True) -> None:
        """Destroy every channel's process groups, then the store (see
        :meth:`LocalChannel.close`); collectives on them raise afterwards. ``destroy``
        False (a process giving up): only let go of them, as a gloo group with a
        collective still waiting on a dead peer would block its destruction."""
        if destroy:
            for channel in self._channels.values():
                channel.close()
        self._channels.clear()
        self._store = None


class _SingleChannel(LocalChannel):
    """A node with one local rank: every collective is the identity."""

    def __init__(self, name: str):  # noqa: D107 - no group to build
        self.name = name
        self.rank = 0
        self.size = 1
