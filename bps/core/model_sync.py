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
    stepped last)."""
    _overwrite_model(model, lambda flat, dtype: node0_to_all(rt, flat, f"init.{dtype}",
                                                             source))


def broadcast_model_in_node(channel, model: torch.nn.Module, local_rank: int) -> None:
    """Overwrite the parameters and buffers of every local rank of this node with local
    rank ``local_rank``'s, over the intra-node ``channel``."""
    def from_local_rank(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        channel.broadcast(flat, root=local_rank)
        return flat

    _overwrite_model(model, from_local_rank)


def _overwrite_model(model: torch.nn.Module, exchange) -> None:
    """Parameters and buffers flattened into one float32 and one float64 tensor, each
    replaced by ``exchange(flat, dtype)``'s result."""
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    for dtype in (torch.float32, torch.float64):
        # float64 carries float64 and integer tensors exactly (|x| < 2**53).
        chosen = [t for t in tensors if (t.dtype == torch.float64 or not t.is_floating_point())
                  == (dtype == torch.float64)]
        if not chosen:
            continue
        flat = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in chosen])
        flat = exchange(flat, dtype)
        offset = 0
        with torch.no_grad():
            for t in chosen:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
