"""The worker engine's codec threads: compress pushes, decompress aggregates.

numba kernels release the GIL, so a few threads compress different partitions at once::

    pool = CodecPool(count=engine_counters.add, tracer=None)
    pool.compress(info, tensor, step, lr, future, then=lambda payload: enqueue(payload))
    pool.decompress(request, frame)     # settles request.future with the aggregate
    pool.shutdown()

``threads=0`` runs every chain on the calling thread instead (the node agent: a
process of its own whose threads would only hand each key from one to the next)::

    pool = CodecPool(count=engine_counters.add, threads=0)   # compress on the pusher's
    pool.decompress(request, frame)     # thread, decode on the I/O thread
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable

import torch
import zmq

from bps.common.protocol import ClusterError, join_frames
from bps.common.trace import Tracer
from bps.compressors.base import NonFiniteError
from bps.compressors.device import OK, is_staged
from bps.worker.device_path import decode_into, on_side_stream, wait_side_stream
from bps.worker.send_queues import KeyInfo, Request, info_label, settle, trace_stage

CODEC_THREADS = min(4, os.cpu_count() or 1)


class CodecPool:
    """Runs key chains on a thread pool; ``count(**deltas)`` adds to the engine's stats."""

    def __init__(self, count: Callable[..., None], tracer: Tracer | None = None,
                 threads: int = CODEC_THREADS) -> None:
        self._count = count
        self._tracer = tracer
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "bps-codec") \
            if threads > 0 else None
        self._closed = False

    def compress(self, info: KeyInfo, tensor: torch.Tensor, step: int, lr: float,
                 future: concurrent.futures.Future,
                 then: Callable[[torch.Tensor, dict | None], None],
                 momentum_scale: float = 1.0, divisor: float = 1.0, what: str = "") -> None:
        """On a codec thread: ``then(payload, None)`` with the compressed ``tensor``, or
        ``then(empty, marker fields)`` where the chain refuses it as non-finite (its
        state unchanged; the marker names ``what``, else the key); any other error
        settles ``future``. ``momentum_scale``: see ``Compressor.scale_momentum``;
        ``divisor``: ``Compressor.divide_input`` (1: none)."""
        self._submit(info, future, self._compress, info, tensor, step, lr, future, then,
                     momentum_scale, divisor, what or info.name)

    def compress_device(self, info: KeyInfo, tensor: torch.Tensor,
                        ready: torch.cuda.Event | None, step: int, lr: float,
                        future: concurrent.futures.Future,
                        then: Callable[[torch.Tensor, dict | None], None],
                        momentum_scale: float = 1.0, what: str = "") -> None:
        """:meth:`compress` for a key on the device path (``info.staging``): on a codec
        thread's side stream, after ``ready``, the chain compresses on the device and only
        its payload is copied to the key's pinned buffer; a raw key is checked for inf and
        NaN and copied down as it is (a ``nonfinite`` marker instead where it has one,
        naming ``what``, else the key)."""
        self._submit(info, future, self._compress_device, info, tensor, ready, step, lr,
                     future, then, momentum_scale, what or info.name)

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
        instead of the caller's thread. Without threads: ``work(*args)`` here."""
        if self._pool is None:
            if self._closed:
                settle(info, future, error=ClusterError("engine closed: cannot schedule "
                                                        "new futures after shutdown"))
                return
            work(*args)
            return
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

    @staticmethod
    def _joined(frames: list[zmq.Frame]) -> torch.Tensor:
        """A reply's payload frames as one uint8 tensor (a view of a lone frame)."""
        if len(frames) > 1:
            return torch.from_numpy(join_frames(frames))
        return torch.frombuffer(frames[0].buffer, dtype=torch.uint8) \
            if len(frames[0]) else torch.zeros(0, dtype=torch.uint8)

    def _decode_on_device(self, info: KeyInfo, frames: list[zmq.Frame]) -> torch.Tensor:
        """A pulled aggregate of a device-path key, copied up and decoded on the device
        into ``info.out`` (a raw key's values cast into it); waits for the side stream."""
        staging = info.staging
        nbytes = sum(len(frame) for frame in frames)
        with on_side_stream(staging.device, None):
            if info.chain is None:
                if nbytes != info.numel * info.dtype.itemsize:
                    raise ValueError(f"{info_label(info)}: the server answered {nbytes} "
                                     f"bytes, expected {info.numel * info.dtype.itemsize}")
                up = staging.to_device(frames, info.dtype)
                result = up if info.out is None else info.out.copy_(up)
            elif staging.host_chain:
                result = decode_into(info.chain, self._joined(frames), info.out)
            else:
                result = staging.decode(info.chain, frames, info.out)
            wait_side_stream(staging.device)
        if staging.device.type == "cuda":
            self._count(pcie_bytes=staging.uploaded if not staging.host_chain
                        else result.numel() * result.element_size())
        return result

    def shutdown(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _compress(self, info: KeyInfo, tensor: torch.Tensor, step: int, lr: float,
                  future: concurrent.futures.Future,
                  then: Callable[[torch.Tensor, dict | None], None],
                  momentum_scale: float, divisor: float, what: str) -> None:
        try:
            start_ns = time.monotonic_ns()
            payload = self._run_chain(info, tensor, step, lr, momentum_scale, divisor)
            if payload is None:
                then(torch.zeros(0, dtype=torch.uint8), {"mark": "nonfinite", "what": what})
                return
            self._compressed(info, step, start_ns, payload)
            then(payload, None)
        except BaseException as exc:
            settle(info, future, error=exc)

    @staticmethod
    def _run_chain(info: KeyInfo, tensor: torch.Tensor, step: int, lr: float,
                   momentum_scale: float, divisor: float = 1.0) -> torch.Tensor | None:
        """The key's chain on ``tensor`` (divided by ``divisor`` in its first pass): its
        payload, or None where the chain refused the input as non-finite (its state
        unchanged)."""
        info.chain.set_lr(lr)
        info.chain.scale_momentum(momentum_scale)
        if divisor != 1.0:
            info.chain.divide_input(divisor)
        try:
            payload = info.chain.compress(tensor)
        except NonFiniteError:
            info.chain.cancel()
            return None
        info.compressed_step = step
        return payload

    @staticmethod
    def _run_staged(info: KeyInfo, tensor: torch.Tensor, step: int, lr: float,
                    momentum_scale: float) -> torch.Tensor | None:
        """:meth:`_run_chain` for a device chain (``bps.compressors.device``): its payload
        and status are copied down together, so one wait serves both; the staged state
        is then committed, or discarded where the status refuses the input."""
        chain, staging = info.chain, info.staging
        chain.set_lr(lr)
        chain.scale_momentum(momentum_scale)
        payload, status = staging.encode(chain, tensor)  # no payload where refused
        if payload is not None:
            payload = staging.to_host(payload)
        status = staging.status_to_host(status)
        wait_side_stream(staging.device)
        code, detail = status.tolist()
        if code != OK:
            chain.discard()
            error = chain.status_error(code, detail)
            if not isinstance(error, NonFiniteError):
                raise error
            chain.cancel()
            return None
        chain.commit()
        info.compressed_step = step
        return payload

    def _compressed(self, info: KeyInfo, step: int, start_ns: int,
                    payload: torch.Tensor) -> None:
        end_ns = time.monotonic_ns()
        self._count(compress_s=(end_ns - start_ns) / 1e9)
        if self._tracer is not None:
            self._tracer.complete("compress", info.name, step, start_ns, end_ns,
                                  bytes=payload.numel() * payload.element_size())

    def _compress_device(self, info: KeyInfo, tensor: torch.Tensor,
                         ready: torch.cuda.Event | None, step: int, lr: float,
                         future: concurrent.futures.Future,
                         then: Callable[[torch.Tensor, dict | None], None],
                         momentum_scale: float, what: str) -> None:
        try:
            start_ns = time.monotonic_ns()
            staging = info.staging
            with on_side_stream(staging.device, ready):
                if info.chain is None:  # raw: copied down with its verdict, one wait
                    bad = staging.nonfinite_flag(tensor)
                    payload = staging.to_host(tensor)
                    wait_side_stream(staging.device)
                    nonfinite = bool(bad[0])
                elif staging.host_chain:  # no device kernels: down, then the host chain
                    host = staging.to_host(tensor)
                    wait_side_stream(staging.device)
                    payload = self._run_chain(info, host, step, lr, momentum_scale)
                    nonfinite = payload is None
                elif is_staged(info.chain):  # payload and verdict down, one wait
                    payload = self._run_staged(info, tensor, step, lr, momentum_scale)
                    nonfinite = payload is None
                else:
                    payload = self._run_chain(info, tensor, step, lr, momentum_scale)
                    nonfinite = payload is None
                    if not nonfinite:
                        payload = staging.to_host(payload)
                        wait_side_stream(staging.device)
            if nonfinite:
                then(torch.zeros(0, dtype=torch.uint8), {"mark": "nonfinite", "what": what})
                return
            if tensor.is_cuda:
                down = payload if info.chain is None or not staging.host_chain else tensor
                self._count(pcie_bytes=down.numel() * down.element_size())
            if info.chain is not None:
                self._compressed(info, step, start_ns, payload)
            then(payload, None)
        except BaseException as exc:
            settle(info, future, error=exc)

    def _decompress(self, request: Request, frames: list[zmq.Frame]) -> None:
        try:
            start_ns = time.monotonic_ns()
            info = request.info
            if info.staging is not None:
                result = self._decode_on_device(info, frames)
            elif len(frames) == 1:  # a view of the frame, as the chain parses any buffer
                result = info.chain.decompress(frames[0].buffer, info.out)
            else:
                result = info.chain.decompress(join_frames(frames), info.out)
            end_ns = time.monotonic_ns()
            self._count(decompress_s=(end_ns - start_ns) / 1e9, pushes=1)
            trace_stage(self._tracer, "decompress", request, start_ns, end_ns)
            settle(request.info, request.future, result)
        except BaseException as exc:
            settle(request.info, request.future, error=exc)
