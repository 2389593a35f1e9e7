"""Moving a key's payloads between its device and the wire, off the step's critical path.

When a gradient lives on a GPU, the node's chain runs there (``bps.compressors.build(...,
device=)``) and only payloads cross PCIe: each codec thread works on a side CUDA stream of
its own, ordered after the gradient by an event recorded on the stream that produced it,
and copies through page-locked host buffers that each key allocates once and reuses.
A pulled aggregate goes the other way: its bytes are staged in the key's pinned buffer,
copied up on the side stream and decoded on the device into the destination.

The codec thread waits for its side stream (an event's ``synchronize``); the threads that
run the model never do.

Example (the forced path on CPU tensors, ``BPS_DEVICE_KERNELS=1``, as the tests run it)::

    >>> import torch
    >>> staging = KeyStaging(torch.device("cpu"))
    >>> with on_side_stream(torch.device("cpu"), ready=None):
    ...     host = staging.to_host(torch.arange(4, dtype=torch.float16))
    >>> host.tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from bps.common.protocol import join_frames
from bps.worker.device_graphs import KeyGraphs

__all__ = ["KeyStaging", "decode_into", "dedicated_stream", "on_side_stream", "record_ready",
           "release_stream", "wait_side_stream"]

_local = threading.local()
log = logging.getLogger("bps")


_taken: set[int] = set()  # the side streams held (codec threads, reduce threads), by handle
_free: dict[int, list] = {}  # device index -> streams given back, for the next taker
_streams: dict[int, torch.cuda.Stream] = {}  # handle -> every stream handed out
_taken_lock = threading.Lock()
_CU_STREAM_NON_BLOCKING = 1  # no implicit sync with the legacy default stream


class _ThreadStreams(dict):
    """A thread's side streams by device index; given back to the pool of free ones when
    the thread ends (its thread-local data goes, and this with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.handles: list[int] = []
        weakref.finalize(self, _give_back, self.handles)


def _give_back(handles: list[int]) -> None:
    with _taken_lock:
        for handle in handles:
            if handle in _taken:
                _taken.discard(handle)
                stream = _streams[handle]
                _free.setdefault(stream.device.index, []).append(stream)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = _ThreadStreams()
    stream = streams.get(device.index)
    if stream is None:
        stream = streams[device.index] = _own_stream(device)
        streams.handles.append(stream.cuda_stream)
    return stream


def _own_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream that no other holder has: a CUDA graph captures whatever is launched on
    its stream, so two threads must never share one. It is bps's own, created through
    the CUDA driver (non-blocking, never destroyed: given back streams are reused), not
    one of torch's pool, which hands its 32 streams a device to any caller in turn (a
    library's, NCCL's). Where the driver cannot be reached, one of the pool's that no
    holder has (logged once)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _taken_lock:
        free = _free.get(device.index)
        stream = free.pop() if free else _private_stream(device) or _pool_stream(device)
        _taken.add(stream.cuda_stream)
        _streams[stream.cuda_stream] = stream
        return stream


def _private_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A new non-blocking stream of ``device`` from the driver, in the device's primary
    context (torch's), or None."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        index = device.index
        torch.cuda.init()
        ordinal, context, handle = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(driver.cuInit(0), "cuInit")
        _check(driver.cuDeviceGet(ctypes.byref(ordinal), index), "cuDeviceGet")
        _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), ordinal),
               "cuDevicePrimaryCtxRetain")  # held for the process, as torch holds it
        _check(driver.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            _check(driver.cuStreamCreateWithPriority(ctypes.byref(handle),
                                                     _CU_STREAM_NON_BLOCKING, 0),
                   "cuStreamCreateWithPriority")
        finally:
            driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))
    except (OSError, AttributeError, RuntimeError) as exc:
        if not _warned:
            _warned.append(True)
            log.warning("no CUDA stream of bps's own (%s): side streams come from torch's "
                        "pool, which other libraries may use too", exc)
        return None


def _check(status: int, call: str) -> None:
    if status != 0:
        raise OSError(f"{call} returned CUDA error {status}")


_warned: list[bool] = []


def _pool_stream(device: torch.device) -> torch.cuda.Stream:
    """One of torch's pool streams that no holder has and that is not current."""
    for _ in range(64):
        stream = torch.cuda.Stream(device)
        if stream.cuda_stream not in _taken and \
                stream.cuda_stream != torch.cuda.current_stream(device).cuda_stream:
            return stream
    raise RuntimeError(f"no CUDA stream of {device} left for a thread of its own")


def dedicated_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of ``device`` that no codec thread nor other caller holds until
    :func:`release_stream` (None on the CPU): a pipeline's reduce thread runs its NCCL
    collectives and casts on one, so that they never queue behind the broadcasts."""
    return _own_stream(device) if device.type == "cuda" else None


def release_stream(stream: torch.cuda.Stream | None) -> None:
    """Give back a :func:`dedicated_stream`."""
    if stream is not None:
        _give_back([stream.cuda_stream])


@contextlib.contextmanager
def on_side_stream(device: torch.device, ready: torch.cuda.Event | None) -> Iterator[None]:
    """Run the body on this thread's side stream of ``device``, after ``ready`` (an event
    recorded where the input was produced); a no-op context on the CPU."""
    if device.type != "cuda":
        yield
        return
    stream = _side_stream(device)
    if ready is not None:
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        yield


def record_ready(device: torch.device) -> torch.cuda.Event | None:
    """An event on the current stream of ``device`` (None on the CPU): work queued so
    far, such as a gradient's division, is done when it completes."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_side_stream(device: torch.device) -> None:
    """Block this (codec) thread until its side stream's work so far is done: on a
    blocking event, so the thread sleeps instead of spinning a core while it waits."""
    if device.type == "cuda":
        event = torch.cuda.Event(blocking=True)  # the thread sleeps; it does not spin a core
        event.record(_side_stream(device))
        event.synchronize()


class KeyStaging:
    """A key's host and device buffers for crossing PCIe, made on first use and reused
    (page-locked on a GPU host: an asynchronous copy needs it, and a fresh pageable
    buffer costs a page fault per 4 KiB). One push_pull of a key is in flight at a time,
    and its pushed bytes have left the worker before its reply arrives, so one set of
    buffers per key suffices."""

    def __init__(self, device: torch.device, cuda_graphs: bool = False, name: str = "") -> None:
        self.device = device
        self.host_chain = False  # the key's chain runs on the host (no device kernels)
        graphs = cuda_graphs and device.type == "cuda"  # replay kernels (worker.device_graphs)
        pool = torch.cuda.graph_pool_handle() if graphs else None  # the key's graphs share it
        self.encode_graphs = KeyGraphs(graphs, f"{name} encode", pool)
        self.decode_graphs = KeyGraphs(graphs, f"{name} decode", pool)
        self._host: torch.Tensor | None = None
        self._up: torch.Tensor | None = None
        self._flag: torch.Tensor | None = None
        self._status: torch.Tensor | None = None
        self.uploaded = 0  # bytes the last upload (to_device, decode) copied up

    def _host_bytes(self, nbytes: int) -> torch.Tensor:
        if self._host is None or self._host.numel() < nbytes:
            pin = self.device.type == "cuda"
            self._host = torch.empty(max(nbytes, 64), dtype=torch.uint8, pin_memory=pin)
        return self._host[:nbytes]

    def encode(self, chain, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key's ``chain.encode(x)``, replayed from a CUDA graph where the chain
        allows (:mod:`bps.worker.device_graphs`); the payload and status tensors are
        overwritten by the key's next encode."""
        key = chain.graph_key() if self.encode_graphs.enabled else None
        if key is None:
            return chain.encode(x)
        x = chain.check_input(x)
        chain.prepare()
        return self.encode_graphs.run(key, (x,), chain.encode_kernels)

    def decode(self, chain, frames: list, out: torch.Tensor | None) -> torch.Tensor:
        """A pulled aggregate (the reply's frames) decoded on the device into ``out``
        (or a new tensor), queued on the current stream: where the compressor checks
        payloads on the host (``decode_key``), it is checked before it goes up and
        decoded without a host sync, from a CUDA graph where they are on; else
        ``chain.decompress`` checks it on the device. A compressor with ``decode_upload``
        (randomk: the indices it draws from the payload's seed) has it build, on the host,
        the bytes that go up instead of the payload."""
        compressor = chain
        while hasattr(compressor, "inner"):  # decorators decode as their compressor
            compressor = compressor.inner
        decode_key = getattr(compressor, "decode_key", None)
        if decode_key is None:
            return decode_into(chain, self.to_device(frames), out)
        payload = self._gather(frames)
        key = decode_key(payload)
        upload = getattr(compressor, "decode_upload", None)  # host work done before it goes up
        up = self._upload(payload if upload is None else self._gather(upload(payload)))
        if key is None:
            return decode_into(chain, up, out)
        result = self.decode_graphs.run(key, (up,), lambda p: compressor.decode_checked(p, key))
        if out is None:  # a graph's output is overwritten by the key's next decode
            return result.clone() if self.decode_graphs.enabled else result
        return out.copy_(result)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Queue the copy of a device tensor into the key's host buffer on the current
        stream; returns the host view (valid once the stream reached it). A CPU tensor is
        returned as it is."""
        if not tensor.is_cuda:
            return tensor
        flat = tensor.reshape(-1)
        host = self._host_bytes(flat.numel() * flat.element_size()).view(flat.dtype)
        host.copy_(flat, non_blocking=True)
        return host

    def status_to_host(self, status: torch.Tensor) -> torch.Tensor:
        """Queue the copy of a device chain's small int64 status into a pinned buffer of
        its own (valid once the stream reached it); a CPU status as it is."""
        if not status.is_cuda:
            return status
        if self._status is None or self._status.numel() < status.numel():
            self._status = torch.empty(status.numel(), dtype=status.dtype, pin_memory=True)
        host = self._status[:status.numel()]
        host.copy_(status, non_blocking=True)
        return host

    def nonfinite_flag(self, tensor: torch.Tensor) -> torch.Tensor:
        """Queue whether ``tensor`` has an inf or NaN: a one-element bool tensor on the
        host, valid once the stream reached it (one byte crosses PCIe)."""
        bad = torch.logical_not(torch.isfinite(tensor).all()).reshape(1)
        if not tensor.is_cuda:
            return bad
        if self._flag is None:
            self._flag = torch.empty(1, dtype=torch.bool, pin_memory=True)
        self._flag.copy_(bad, non_blocking=True)
        return self._flag

    def to_device(self, data: np.ndarray | list, dtype: torch.dtype = torch.uint8
                  ) -> torch.Tensor:
        """Host bytes (a uint8 array, or the ``zmq.Frame``s of a reply) as a tensor of
        ``dtype`` on the key's device, queued on the current stream: gathered into the
        pinned buffer (numpy copies, one thread: torch's CPU copies would start an
        OpenMP team on every codec thread at once), then copied up asynchronously into
        the key's device buffer, which the next call overwrites. On the CPU: the bytes
        themselves (frames joined into a new array)."""
        host = self._gather(data)
        if self.device.type != "cuda" and not host.size:
            return torch.zeros(0, dtype=dtype)
        return self._upload(host).view(dtype)

    def _gather(self, data: np.ndarray | list) -> np.ndarray:
        """Host bytes (a uint8 array, or a reply's frames) where an upload starts: in the
        key's pinned buffer on a GPU; on the CPU the bytes themselves (frames joined)."""
        if self.device.type != "cuda":
            return join_frames(data) if isinstance(data, list) else data
        nbytes = sum(len(frame) for frame in data) if isinstance(data, list) else data.size
        host = self._host_bytes(nbytes).numpy()
        if isinstance(data, list):
            join_frames(data, host)
        else:
            np.copyto(host, data)
        return host

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        """Bytes in the key's pinned buffer (``host``, a view of it) copied up into the
        key's device buffer, queued on the current stream; on the CPU, as a tensor."""
        if self.device.type != "cuda":
            return torch.from_numpy(host)
        nbytes = self.uploaded = host.size
        if self._up is None or self._up.numel() < nbytes:
            self._up = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=self.device)
        up = self._up[:nbytes]
        up.copy_(self._host_bytes(nbytes), non_blocking=True)
        return up

def decode_into(chain, payload: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``chain.decompress(payload)`` written into ``out``, which may have another float
    dtype (a node's float16 sum) or live elsewhere (a host chain's result for a device
    destination): then decoded first and cast or copied into it."""
    if out is None or (out.dtype == chain.dtype and out.device == payload.device):
        return chain.decompress(payload, out)
    return out.copy_(chain.decompress(payload))
