"""A CPU stand-in for a CUDA graph, strict where a real one is: what a replay would miss
shows up on the CPU.

A CUDA graph records the kernels that a function launched, with every argument they had
then: tensors by their memory, Python numbers by value. Replaying it runs those kernels
again and runs no Python. :class:`RecordedGraphs` is :class:`KeyGraphs` with ``record``
done by a ``TorchDispatchMode`` instead: it records each aten op with its arguments (the
very tensor objects, the numbers as they were), and ``replay`` runs the ops again on
them, writing each op's new result into the tensor it returned when recorded. A chain
whose kernels read a Python number that changes between steps, or a tensor that is
replaced instead of written in place, gives other bytes than running eagerly; a host
sync while recording (``.item()``, ``.tolist()``) raises, as a capture would fail.

Example::

    staging = KeyStaging(torch.device("cpu"))
    staging.encode_graphs = RecordedGraphs()
    payload, status = staging.encode(chain, x)   # eager, then recorded, then replayed
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bps.worker.device_graphs import KeyGraphs

ALLOCATIONS = {"empty", "empty_like", "empty_strided"}  # memory, not kernels


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host sync while capturing")  # a capture fails on it
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """The ops one call launched; ``replay`` runs them again on the same tensors."""

    def __init__(self, ops: list[tuple]) -> None:
        self.ops = ops

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            schema = func._schema
            if func._opname in ALLOCATIONS:
                continue
            if any(r.alias_info is not None and not r.alias_info.is_write
                   for r in schema.returns):
                continue  # a view: it shares the memory of what it views
            writes = any(a.alias_info is not None and a.alias_info.is_write
                         for a in schema.arguments)
            new = func(*args, **kwargs)
            if not writes:  # a new result: into the tensor the recording returned
                for old, value in zip(tree_flatten(out)[0], tree_flatten(new)[0],
                                      strict=True):
                    if isinstance(old, torch.Tensor):
                        old.copy_(value)


class RecordedGraphs(KeyGraphs):
    """:class:`KeyGraphs`, enabled on the CPU, recording with :class:`RecordedGraph`."""

    def __init__(self, name: str = "") -> None:
        super().__init__(enabled=True, name=name)

    def record(self, fn, inputs: tuple[torch.Tensor, ...]) -> tuple:
        recorder = _Recorder()
        with recorder:
            outputs = fn(*inputs)  # also runs, unlike a capture: encode_kernels only
        return RecordedGraph(recorder.ops), outputs  # writes scratch buffers, no state
