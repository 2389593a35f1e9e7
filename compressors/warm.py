"""Compile the host chains' numba kernels before a job: ``python -m bps.compressors.warm``.

numba keeps compiled kernels on disk (``cache=True``), but on a cold cache every process
of a job compiles the kernels it needs inside its first steps, each for itself: a
``bpslaunch local`` job with two workers and a server compiles the same kernels three
times over, on cores its training needs. :func:`warm_kernels` runs every call a step
makes through a throwaway worker chain and server chain of each configuration, so the
job's processes load the kernels instead. ``make setup`` runs it once. Loading from the
cache still costs a process's first kernel numba's start-up; :func:`load_soon` pays it
on a thread of its own while a job starts (trainers and servers call it).

Example::

    >>> from bps.compressors.warm import warm_kernels
    >>> warm_kernels([{"compressor": "onebit", "ef": "vanilla"}], numel=64)  # 3 dtypes
    3
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .base import ErrorPassCompress
from .finite import divide_checked, tensor_finite
from .registry import build, compressor_class, description, registered_names

log = logging.getLogger("bps.compressors")



def builtin_chains() -> tuple[dict, ...]:
    """Every registered compressor's host chains in the forms jobs use most: error
    feedback and the worker's Nesterov momentum around each described example and its
    typical options (``Compressor.description``), and error feedback alone where the
    compressor builds its input in its own kernel then (onebit: ``ErrorPassCompress``).
    A compressor whose payloads are summed as they are (powersgd: torch matrix
    products) has nothing to compile.

        >>> {"compressor": "topk", "k": 0.01, "ef": "vanilla", "momentum": "nesterov"} in (
        ...     builtin_chains())
        True
    """
    chains: list[dict] = []
    for name in registered_names():
        told = description(name)
        if told.payloads_sum:
            continue
        in_pass = issubclass(compressor_class({"compressor": name}), ErrorPassCompress)
        forms = ({"momentum": "nesterov"}, {}) if in_pass else ({"momentum": "nesterov"},)
        for options in (*told.examples, told.defaults):
            for momentum in forms:
                params = {"compressor": name, **options, "ef": "vanilla", **momentum}
                if params not in chains:
                    chains.append(params)
    return tuple(chains)


BUILTIN_CHAINS: tuple[dict, ...] = builtin_chains()
# bfloat16's bit kernels are float16's (16-bit words)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.float64)


def warm_kernels(chains: Iterable[dict] = BUILTIN_CHAINS, numel: int = 4096,
                 dtypes: Sequence[torch.dtype] = KERNEL_DTYPES) -> int:
    """Compile (or load from numba's cache) the kernels of each chain in ``chains``, a
    ``compression_params`` dict each, for partitions of each dtype in ``dtypes``; returns
    how many chains ran. PowerSGD has nothing to compile (torch matrix products)."""
    ran = 0
    for dtype in dtypes:
        tensor_finite(torch.ones(numel, dtype=dtype))  # the servers' check of raw pushes
        for params in chains:
            params = {**params, "mu": 0.9} if params.get("momentum") else params
            _run_chain(params, numel, dtype)
            ran += 1
    return ran


def _run_chain(params: dict, numel: int, dtype: torch.dtype) -> None:
    """Two steps of a throwaway worker chain and server chain of ``params``: every call
    a step makes, on the payload forms a job sees. The values are drawn from no random
    generator: this may run beside a job."""
    worker = build(params, numel, dtype)
    server = build(params, numel, dtype, role="server")
    out, total = torch.empty(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
    for lr in (0.05, 0.04):  # the second step rescales error feedback's error
        worker.set_lr(lr)
        server.set_lr(lr)
        payload = worker.compress(torch.linspace(-1.0, 1.0, numel, dtype=dtype))
        # a payload from a ZeroMQ frame is read-only: numba compiles that apart
        for form in (payload, payload.numpy().tobytes()):
            server.decompress(form, total)
            server.decompress_add(form, total, out)
        pulled = server.compress(total)
        if getattr(server, "sums_payloads", False):  # a server sums these in one pass
            pulled = server.compress_sum([payload, payload.numpy().tobytes()])
        for form in (pulled, pulled.numpy().tobytes()):
            worker.decompress(form, out)


_started: set[str] = set()  # the (params, dtype) whose kernels load_soon has loaded
_loading: list[threading.Thread] = []
_lock = threading.Lock()
LOAD_NUMEL = 1024  # big enough for every kernel's code path, small enough to cost nothing


def load_soon(params: dict | None, dtype: torch.dtype) -> None:
    """Start loading, on a thread of its own, the numba kernels that a host chain of
    ``params`` (None: an uncompressed key) runs on ``dtype`` partitions, and those of the
    inf/NaN checks; once per process for each ``(params, dtype)``.

    A process's first numba kernel initialises numba's code generator (0.4 s on an idle
    core; 1.3 s while the 8 processes of a 4-node job start on 2 cores). Workers call
    this when they declare their keys and servers when a key is declared, so that cost
    overlaps the rest of the start-up instead of stalling the first push. The throwaway
    chains draw no random numbers, so a job's results do not change.

        >>> load_soon({"compressor": "onebit"}, torch.float32); wait_loaded(timeout=60)
        True
    """
    tag = json.dumps(params, sort_keys=True, default=str) + str(dtype)
    with _lock:
        if tag in _started:
            return
        _started.add(tag)
        thread = threading.Thread(target=_load, args=(params, dtype),
                                  name="bps-kernel-load", daemon=True)
        _loading.append(thread)
    thread.start()


def wait_loaded(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds in all for the loads :func:`load_soon` started;
    whether they all finished."""
    deadline = time.monotonic() + timeout
    with _lock:
        threads = list(_loading)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def _load(params: dict | None, dtype: torch.dtype) -> None:
    values = torch.linspace(-1.0, 1.0, LOAD_NUMEL)
    divide_checked(values.numpy().copy(), 2.0, np.inf)  # a worker's push of its share
    tensor_finite(values.to(dtype))  # a server's check of an uncompressed push
    # a chain whose options fix its size (powersgd's matrix shape, set per key) has no
    # chain of LOAD_NUMEL elements: its kernels load with its first step
    if params is None or params.get("compressor") is None:
        return
    if "shape" in getattr(compressor_class(params), "keys", {}):
        return
    try:
        _run_chain(params, LOAD_NUMEL, dtype)
    except Exception as exc:  # a job's own steps will meet it: no traceback from here
        log.warning("the kernels of %s were not loaded ahead: %s: %s",
                    params["compressor"], type(exc).__name__, exc)


def main() -> int:
    started = time.monotonic()
    ran = warm_kernels()
    print(f"bps: the kernels of {ran} compressor chains compiled or loaded from numba's "
          f"cache in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
