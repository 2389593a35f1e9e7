"""The collectives a trainer runs once, before training: every rank gets rank 0's model.

:func:`check_same_model` compares every rank's parameter and buffer names, shapes and
dtypes with rank 0's and raises :class:`ModelMismatchError` naming the first
difference; :func:`broadcast_model` then overwrites every rank's values with rank 0's.
Both go through the servers (raw keys) between nodes and the node-local group within
one. Usage (every rank, inside ``DistributedTrainer``)::

    rt = bps.core.runtime.get()
    check_same_model(rt, model)
    broadcast_model(rt, model)
"""

from __future__ import annotations

import json

import torch

from bps.worker.partition import partition


class ModelMismatchError(ValueError):
    """The model's parameters or buffers differ between workers."""


def signature(model: torch.nn.Module) -> list:
    """``[kind, name, shape, dtype]`` of every parameter, then every buffer."""
    entries = [["param", n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
    entries += [["buffer", n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()]
    return entries


def first_difference(mine: list, reference: list) -> int:
    """1 + index of the first entry of ``reference`` that ``mine`` lacks or changes; 0 if equal.

        >>> first_difference([["param", "w", [2], "f"]], [["param", "w", [3], "f"]])
        1
    """
    for i, entry in enumerate(reference):
        if i >= len(mine) or mine[i] != entry:
            return i + 1
    return len(reference) + 1 if len(mine) > len(reference) else 0


def _root_push_pull_from_node0(rt, flat: torch.Tensor, name: str, source: int = 0
                               ) -> torch.Tensor:
    """On local rank 0: node ``source``'s ``flat`` (raw, summed with zeros from the other
    nodes)."""
    engine = rt.engine
    pieces = partition(flat.numel(), flat.element_size(), rt.env.partition_bytes)
    first = rt.allocate_keys(len(pieces))
    mine = flat if rt.node_id == source else torch.zeros_like(flat)
    for i, (_, length) in enumerate(pieces):
        engine.declare(first + i, length, flat.dtype, None, name=f"{name}[{i}]")
    futures = [
        engine.push_pull(first + i, mine[offset:offset + length].contiguous(), 0, 0.0)
        for i, (offset, length) in enumerate(pieces)
    ]
    out = torch.empty_like(flat)
    for (offset, length), fut in zip(pieces, futures, strict=True):
        out[offset:offset + length].copy_(fut.result(timeout=rt.env.timeout * 2))
    return out


def node0_to_all(rt, flat: torch.Tensor, name: str, source: int = 0) -> torch.Tensor:
    """Every rank gets local rank 0 of node ``source``'s ``flat`` (node 0 by default;
    same shape and dtype on every rank)."""
    if rt.local_rank == 0:
        flat = _root_push_pull_from_node0(rt, flat, name, source)
    else:
        pieces = partition(flat.numel(), flat.element_size(), rt.env.partition_bytes)
        rt.allocate_keys(len(pieces))
    rt.setup_channel.broadcast(flat)
    return flat


def sum_over_nodes(rt, tensor: torch.Tensor, name: str) -> torch.Tensor:
    """On local rank 0: the sum of ``tensor`` over all worker nodes."""
    engine = rt.engine
    key = rt.allocate_keys(1)
    if engine is None:
        return tensor
    engine.declare(key, tensor.numel(), tensor.dtype, None, name=name)
    return engine.push_pull(key, tensor, 0, 0.0).result(timeout=rt.env.timeout * 2)


def check_same_model(rt, model: torch.nn.Module) -> None:
    """Compare every rank's parameter/buffer names, shapes and dtypes with rank 0's."""
    mine = signature(model)
    encoded = json.dumps(mine).encode()
    length = node0_to_all(rt, torch.tensor([len(encoded)], dtype=torch.float64), "sig.len")
    raw = torch.zeros(int(length.item()), dtype=torch.float32)
    if rt.rank == 0:
        raw.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    reference = json.loads(bytes(node0_to_all(rt, raw, "sig").to(torch.uint8).tolist()))
    # Every rank reports its first difference; all ranks learn all verdicts.
    verdict = torch.zeros(rt.size, dtype=torch.float64)
    verdict[rt.rank] = first_difference(mine, reference)
    rt.setup_channel.reduce(verdict)
    verdict = sum_over_nodes(rt, verdict, "sig.verdict")
    rt.setup_channel.broadcast(verdict)
    bad = [(r, int(v)) for r, v in enumerate(verdict.tolist()) if v]
    if bad:
        rank, index = bad[0]
        if index > len(reference):
            what = f"rank {rank} has more parameters/buffers than rank 0"
        else:
            kind, name, shape, dtype = reference[index - 1]
            detail = ""
            if rank == rt.rank and len(mine) >= index:
                _, my_name, my_shape, my_dtype = mine[index - 1]
                detail = (f"; rank {rank} has {my_name!r} with shape {tuple(my_shape)}, "
                          f"{my_dtype}")
            what = (f"{kind} {name!r} (shape {tuple(shape)}, {dtype} on rank 0) is missing "
                    f"or different on rank {rank}{detail}")
        raise ModelMismatchError(f"the model differs across workers: {what}")


def broadcast_model(rt, model: torch.nn.Module, source: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with those of node ``source``'s
    local rank 0 (rank 0 by default; ``DistributedTrainer.join`` passes the node that
    stepped last), bit for bit: inf and NaN (a ``-inf`` causal mask), every dtype,
    integers of any size. The bytes travel as 16-bit halves, each a float32 in
    ``[0, 65535]``: finite (the servers refuse non-finite pushes, which is meant for
    gradients), exact in float32, and unchanged by the zeros the other nodes add."""
    def from_node(raw: torch.Tensor) -> torch.Tensor:
        return float_to_bytes(node0_to_all(rt, bytes_to_float(raw), "init.bits", source))

    _overwrite_model(model, from_node)


def broadcast_model_in_node(channel, model: torch.nn.Module, local_rank: int) -> None:
    """Overwrite the parameters and buffers of every local rank of this node with local
    rank ``local_rank``'s, over the intra-node ``channel`` (bit for bit)."""
    def from_local_rank(raw: torch.Tensor) -> torch.Tensor:
        channel.broadcast(raw, root=local_rank)
        return raw

    _overwrite_model(model, from_local_rank)


def bytes_to_float(raw: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor as float32 values in ``[0, 65535]``, one per 16-bit half (a zero
    byte pads an odd length); :func:`float_to_bytes` inverts it.

        >>> bytes_to_float(torch.tensor([1, 2, 255], dtype=torch.uint8)).tolist()
        [513.0, 255.0]
    """
    padded = torch.cat([raw, raw.new_zeros(raw.numel() % 2)])
    halves = padded.view(torch.int16).to(torch.int32)
    return torch.where(halves < 0, halves + 65536, halves).to(torch.float32)


def float_to_bytes(values: torch.Tensor) -> torch.Tensor:
    """The bytes that :func:`bytes_to_float` made ``values`` of (with the pad byte)."""
    halves = values.to(torch.int32)
    halves = torch.where(halves >= 32768, halves - 65536, halves).to(torch.int16)
    return halves.view(torch.uint8)


def _overwrite_model(model: torch.nn.Module, exchange) -> None:
    """Every parameter's and buffer's bytes in one uint8 tensor, replaced by
    ``exchange(raw)``'s result (at least as long)."""
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    if not tensors:
        return
    raw = torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                     for t in tensors])
    raw = exchange(raw)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            size = t.numel() * t.element_size()
            chunk = raw[offset:offset + size].clone().view(t.dtype)
            t.copy_(chunk.view_as(t))
            offset += size
