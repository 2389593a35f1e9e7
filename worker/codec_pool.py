"""The worker engine's codec threads: compress pushes, decompress aggregates.

numba kernels release the GIL, so a few threads compress different partitions at once::

    pool = CodecPool(count=engine_counters.add, tracer=None)
    pool.compress(info, tensor, step, lr, future, then=lambda payload: enqueue(payload))
    pool.decompress(request, frame)     # settles request.future with the aggregate
    pool.shutdown()
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable

import torch
import zmq

from bps.compressors.base import NonFiniteError
from bps.protocol import ClusterError, join_frames
from bps.trace import Tracer
from bps.worker.send_queues import KeyInfo, Request, settle, trace_stage

CODEC_THREADS = min(4, os.cpu_count() or 1)


class CodecPool:
    """Runs key chains on a thread pool; ``count(**deltas)`` adds to the engine's stats."""

    def __init__(self, count: Callable[..., None], tracer: Tracer | None = None,
                 threads: int = CODEC_THREADS) -> None:
        self._count = count
        self._tracer = tracer
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "bps-codec")

    def compress(self, info: KeyInfo, tensor: torch.Tensor, step: int, lr: float,
                 future: concurrent.futures.Future,
                 then: Callable[[torch.Tensor, dict | None], None],
                 momentum_scale: float = 1.0) -> None:
        """On a codec thread: ``then(payload, None)`` with the compressed ``tensor``, or
        ``then(empty, marker fields)`` where the chain refuses it as non-finite (its
        state unchanged); any other error settles ``future``. ``momentum_scale``: see
        ``Compressor.scale_momentum``."""
        self._submit(info, future, self._compress, info, tensor, step, lr, future, then,
                     momentum_scale)

    def decompress(self, request: Request, frames: list[zmq.Frame]) -> None:
        """On a codec thread: decode the aggregate of ``request`` (its payload frames)
        and settle its future."""
        self._submit(request.info, request.future, self._decompress, request, frames)

    def then(self, info: KeyInfo, future: concurrent.futures.Future,
             done: concurrent.futures.Future,
             step: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """On a codec thread, once ``done`` (one round of a multi-round key) resolved:
        ``step(its sum)``; a tensor it returns settles ``future`` (the last round), an
        error in ``done`` or ``step`` fails it."""
        self._submit(info, future, self._then, info, future, done, step)

    def _submit(self, info: KeyInfo, future: concurrent.futures.Future,
                work: Callable[..., None], *args: object) -> None:
        """Run ``work(*args)`` on a codec thread; once the pool or the interpreter is
        shutting down (a reply that arrives as the process exits), fail ``future``
        instead of the caller's thread."""
        try:
            self._pool.submit(work, *args)
        except RuntimeError as exc:  # cannot schedule new futures after (interpreter) shutdown
            settle(info, future, error=ClusterError(f"engine closed: {exc}"))

    def _then(self, info: KeyInfo, future: concurrent.futures.Future,
              done: concurrent.futures.Future,
              step: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        try:
            summed = done.result()
            start_ns = time.monotonic_ns()
            result = step(summed)
            self._count(compress_s=(time.monotonic_ns() - start_ns) / 1e9)
            if result is not None:
                settle(info, future, result)
        except BaseException as exc:
            settle(info, future, error=exc)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _compress(self, info: KeyInfo, tensor: torch.Tensor, step: int, lr: float,
                  future: concurrent.futures.Future,
                  then: Callable[[torch.Tensor, dict | None], None],
                  momentum_scale: float) -> None:
        try:
            start_ns = time.monotonic_ns()
            info.chain.set_lr(lr)
            info.chain.scale_momentum(momentum_scale)
            try:
                payload = info.chain.compress(tensor)
            except NonFiniteError:
                info.chain.cancel()
                then(torch.zeros(0, dtype=torch.uint8), {"mark": "nonfinite", "what": info.name})
                return
            info.compressed_step = step
            end_ns = time.monotonic_ns()
            self._count(compress_s=(end_ns - start_ns) / 1e9)
            if self._tracer is not None:
                self._tracer.complete("compress", info.name, step, start_ns, end_ns,
                                      bytes=payload.numel() * payload.element_size())
            then(payload, None)
        except BaseException as exc:
            settle(info, future, error=exc)

    def _decompress(self, request: Request, frames: list[zmq.Frame]) -> None:
        try:
            start_ns = time.monotonic_ns()
            if len(frames) > 1:
                data = torch.from_numpy(join_frames(frames))
            else:
                data = torch.frombuffer(frames[0].buffer, dtype=torch.uint8) \
                    if len(frames[0]) else torch.zeros(0, dtype=torch.uint8)
            result = request.info.chain.decompress(data, request.info.out)
            end_ns = time.monotonic_ns()
            self._count(decompress_s=(end_ns - start_ns) / 1e9, pushes=1)
            trace_stage(self._tracer, "decompress", request, start_ns, end_ns)
            settle(request.info, request.future, result)
        except BaseException as exc:
            settle(request.info, request.future, error=exc)
