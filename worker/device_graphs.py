"""A key's device kernels replayed from CUDA graphs: one launch instead of dozens.

A chain on a GPU compresses a partition in some 50 small kernels and decodes an
aggregate in about 10. Each is launched from Python by a codec thread that holds the GIL
while it does, so with a few dozen keys a step those launches, not the GPU, set the
step's time. Where a key's kernels depend only on tensors (a chain's ``graph_key()``,
a compressor's ``decode_key()``: ``bps.compressors.device``), they are captured into a
CUDA graph once and replayed after that: a replay is one launch.

The first run of a key's kernels is eager (lazy initialisation cannot be captured); the
next captures them on static input buffers; each later one copies its inputs into those
buffers and replays the graph captured for the same key (error feedback alternates
between two buffers, so its encode holds two graphs). Results come back in the graph's
own output tensors, which the key's next replay overwrites: one push_pull of a key is
in flight at a time, and its results are copied out before the next.

``BPS_CUDA_GRAPHS=0`` turns this off (the kernels run eagerly, as on the CPU). A key
that asks for more than :data:`MAX_CAPTURES` captures, or whose capture fails, runs
eagerly from then on (logged once).

The graphs of one key share a memory pool: they never run at once (one push_pull of a
key is in flight, and each replay's outputs are copied out before the key's next).
Different keys' graphs do run at once, on different codec threads, so each key has a
pool of its own: a key keeps about one capture's intermediates on its device.

Example (on a codec thread's side stream, as :mod:`bps.worker.device_path` runs it)::

    graphs = KeyGraphs(enabled=True, name="fc.weight[0] encode")
    payload, status = graphs.run(chain.graph_key(), (x,), chain.encode_kernels)
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["ENV_SWITCH", "MAX_CAPTURES", "KeyGraphs", "enabled_by_env", "private_generator",
           "release_pool"]

log = logging.getLogger("bps")

ENV_SWITCH = "BPS_CUDA_GRAPHS"
MAX_CAPTURES = 8  # per key: more means its buffers or branches keep changing
MAX_GRAPHS = 4  # per key: the least recently captured goes first
_capture_lock = threading.Lock()  # one capture at a time in the process


def enabled_by_env(environ: dict | None = None) -> bool:
    """Whether ``BPS_CUDA_GRAPHS`` (default 1) lets device kernels replay CUDA graphs.

        >>> enabled_by_env({}), enabled_by_env({"BPS_CUDA_GRAPHS": "0"})
        (True, False)
    """
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {ENV_SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


class KeyGraphs:
    """One key's kernels of one kind (encode, decode) run as ``fn(*inputs)``, replayed
    from a CUDA graph per ``key`` where enabled; ``enabled`` only on a CUDA device."""

    def __init__(self, enabled: bool, name: str = "", pool: tuple | None = None) -> None:
        self.enabled = enabled
        self.name = name
        self.pool = pool  # a memory pool the key's graphs share (graph_pool_handle())
        self.captures = 0
        self.replays = 0
        self._inputs: tuple[torch.Tensor, ...] | None = None
        self._graphs: dict[tuple, tuple] = {}  # key -> (graph, its outputs)
        self._eager_runs = 0

    def run(self, key: tuple | None, inputs: tuple[torch.Tensor, ...],
            fn: Callable[..., object]) -> object:
        """``fn(*inputs)`` on the current (side) stream, or the replay of the graph that
        captured it for ``key`` (None: always eager). ``fn`` launches kernels only: no
        host sync, no Python number that is not in ``key``."""
        if key is None or not self.enabled:
            return fn(*inputs)
        if key not in self._graphs:
            if self.captures >= MAX_CAPTURES:
                self._stop(f"it asked for more than {MAX_CAPTURES} captures")
            if self._eager_runs == 0 or not self.enabled:
                self._eager_runs += 1
                return fn(*inputs)
        self._load(inputs)  # before a capture too: a recording that runs (tests) reads them
        entry = self._graphs.get(key) or self._capture(key, fn)
        if entry is None:
            return fn(*inputs)
        entry[0].replay()
        self.replays += 1
        return entry[1]

    def _load(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Copy ``inputs`` into the static input buffers (made on first use, or anew,
        dropping the graphs, where their shapes change)."""
        if self._inputs is None or any(s.shape != v.shape or s.dtype != v.dtype
                                       for s, v in zip(self._inputs, inputs, strict=True)):
            self._inputs = tuple(torch.empty_like(value) for value in inputs)
            self._graphs.clear()
        for static, value in zip(self._inputs, inputs, strict=True):
            static.copy_(value)

    def _capture(self, key: tuple, fn: Callable[..., object]) -> tuple | None:
        """Capture ``fn`` on the static inputs (nothing runs yet); None where the
        capture failed (the key runs eagerly from then on)."""
        with _capture_lock:
            try:
                graph, outputs = self.record(fn, self._inputs)
            except RuntimeError as exc:
                self._stop(f"capturing it failed: {exc}")
                return None
        self.captures += 1
        if len(self._graphs) >= MAX_GRAPHS:
            del self._graphs[next(iter(self._graphs))]
        self._graphs[key] = (graph, outputs)
        return self._graphs[key]

    def record(self, fn: Callable[..., object], inputs: tuple[torch.Tensor, ...]) -> tuple:
        """``(graph, outputs)``: ``fn(*inputs)`` captured into a CUDA graph on the current
        stream (nothing runs; ``graph.replay()`` runs it). Tests record otherwise.

        The capture is ``thread_local`` (another thread's CUDA calls do not break it) and
        runs with a generator state of its own (:func:`private_generator`): the model's
        threads keep drawing random numbers while it runs. The pool handle is taken
        before the capture, so a failed capture can still hand its pool back."""
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with private_generator(torch.cuda.current_device()):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn(*inputs)
            finally:
                graph.capture_end()
        except RuntimeError:
            release_pool(torch.cuda.current_device(), pool)
            raise
        return graph, outputs

    def _stop(self, why: str) -> None:
        if self.enabled:
            log.warning("%s: %s; its kernels run without CUDA graphs from now on (%s=0 "
                        "turns them off for every key)", self.name or "a key", why, ENV_SWITCH)
        self.enabled = False
        self._graphs.clear()


@contextlib.contextmanager
def private_generator(device: int) -> Iterator[None]:
    """A capture begun in the body registers a private state of the device's default
    CUDA generator instead of the one every thread draws from.

    torch registers the default generator's state with every graph it captures and
    marks it "capturing" until the capture ends; meanwhile a draw on any other thread
    (dropout, ``torch.rand(device="cuda")``) fails ("Offset increment outside graph
    capture"). The kernels captured here draw nothing, so the capture gets a clone of
    the state, and the shared state is put back as soon as ``capture_begin`` returns:
    a draw elsewhere within that call's few microseconds meets the clone, already
    marked, and still fails (torch always registers the default generator). Nothing is
    done where torch has no ``graphsafe_set_state``."""
    default = torch.cuda.default_generators[device]
    if not hasattr(default, "graphsafe_set_state"):
        yield
        return
    shared = default.graphsafe_get_state()
    default.graphsafe_set_state(default.clone_state())
    try:
        yield
    finally:
        default.graphsafe_set_state(shared)


def release_pool(device: int, pool: tuple) -> None:
    """After a failed capture: let the caching allocator stop routing the capturing
    thread's allocations to ``pool`` (torch's ``capture_end`` raises before it does so
    itself); best effort, through torch's private hooks where this version has them.
    ``pool`` is the handle the capture was given: the graph's own ``pool()`` raises
    once its capture failed."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    try:
        if end is not None:
            end(device, pool)
    except (RuntimeError, TypeError):
        pass
