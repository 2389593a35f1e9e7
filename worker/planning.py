"""What a trainer sends where: parameters cut into parts, parts into keys, keys onto servers.

Each float32 parameter is cut into partitions of ``BYTEPS_PARTITION_BYTES``; a partition
travels on a compressed key where its compressor's payload is smaller than the raw
bytes, else on a raw key (also during warmup). Small tensors close to each other in
backward order (at most a partition of other gradients apart) share a bucket (one raw
key), and every key goes to a server so that the bytes a step pushes are balanced::

    >>> import torch
    >>> params = {"compressor": "onebit", "scaling": False, "k": None, "seed": 1,
    ...           "min_compress_bytes": 1024, "warmup_steps": 0}
    >>> parts, keys, small = plan_tensor("w", 4096, params, torch.float16, 4096000)
    >>> [(k.field, k.wire_bytes) for k in keys], small
    ([('compressed_key', 516)], None)
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass

import torch

from bps.compressors import WholeTensor, compressor_class, payload_bound
from bps.worker.partition import partition, plan_servers


@dataclass
class Part:
    """A partition of a parameter and the keys it travels on."""

    offset: int
    length: int
    raw_key: int | None = None  # travels uncompressed (always, or during warmup)
    compressed_key: int | None = None
    converted: torch.Tensor | None = None  # the piece in its key's dtype, reused every step
    bucket: Bucket | None = None  # travels fused with other small tensors, at bucket_offset
    bucket_offset: int = 0
    in_bucket: torch.Tensor | None = None  # its view of the bucket's buffer, made at first use
    only: str | None = None  # "warmup" / "compressed": travels in those steps alone

    def travels(self, warm: bool) -> bool:
        """Whether this part carries the tensor in a step (``warm``: within warmup)."""
        return self.only is None or (self.only == "warmup") == warm


@dataclass
class Bucket:
    """Small tensors close to each other in backward order that travel as one raw key
    (DDP's buckets, Horovod's tensor fusion): one message instead of one per tensor."""

    name: str
    numel: int
    members: int
    key: int | None = None
    buffer: torch.Tensor | None = None  # in the wire dtype; written by the reduce thread
    arrived: int = 0  # members copied in this step
    future: concurrent.futures.Future | None = None  # this step's aggregate
    mark: tuple[str, str] | None = None  # this step's (marker, member): pushed instead
    # float32 values of a float16/bfloat16 buffer, which its members are divided into
    # and its aggregate widened into (GradPipeline.push_fused)
    staged: torch.Tensor | None = None


@dataclass
class KeyPlan:
    """A key to declare once every key's server is planned."""

    part: Part | Bucket
    field: str  # the attribute of ``part`` that receives the key
    name: str
    numel: int
    dtype: torch.dtype
    params: dict | None
    wire_bytes: int  # bytes one push carries (at most)
    warmup_only: bool = False


def plan_tensor(name: str, numel: int, params: dict, wire_dtype: torch.dtype,
                partition_bytes: int, shape: tuple | None = None
                ) -> tuple[list[Part], list[KeyPlan], Part | None]:
    """The parts of a float32 tensor and the keys they need (``params``: validated
    compression_params; ``shape``: the tensor's, for a compressor that takes tensors
    whole). The third value is the tensor's only part where it is small and raw: it goes
    to :func:`plan_buckets` instead of getting a key here."""
    compress = params["compressor"] is not None and numel * 4 >= params["min_compress_bytes"]
    cls = compressor_class(params)
    if cls is not None and issubclass(cls, WholeTensor):
        whole = cls.tensor_shape(shape, params) if compress else None
        if whole is not None:
            return _plan_whole(name, numel, params, wire_dtype, whole, partition_bytes)
        compress = False  # vectors, biases, tensors the compressor would not shrink: raw
    parts: list[Part] = []
    keys: list[KeyPlan] = []
    small = None
    pieces = partition(numel, 4, partition_bytes)
    for offset, length in pieces:
        part = Part(offset, length)
        raw_bytes = length * wire_dtype.itemsize
        bound = payload_bound(params, length) if compress else None
        part_compressed = compress and (bound is None or bound < raw_bytes)
        label = f"{name}[{len(parts)}]"
        if (not part_compressed and len(pieces) == 1
                and numel * 4 < params["min_compress_bytes"]):
            small = part  # fused, or a raw key of its own
        elif not part_compressed or params["warmup_steps"] > 0:
            # a raw key of a compressed part carries traffic only during warmup
            keys.append(KeyPlan(part, "raw_key", label, length, wire_dtype, None,
                                raw_bytes, warmup_only=part_compressed))
        if part_compressed:
            keys.append(KeyPlan(part, "compressed_key", label, length, torch.float32,
                                params, raw_bytes if bound is None else bound))
        parts.append(part)
    return parts, keys, small


def _plan_whole(name: str, numel: int, params: dict, wire_dtype: torch.dtype,
                shape: list[int], partition_bytes: int
                ) -> tuple[list[Part], list[KeyPlan], None]:
    """A tensor that its compressor takes whole (``WholeTensor``: PowerSGD's matrices,
    whose factors need every row) travels on one compressed key, in ``shape``; during
    warmup it travels raw, in partitions like any raw tensor (whole, it could be larger
    than a key may be)."""
    key_params = dict(params, shape=shape)
    whole = Part(0, numel, only="compressed" if params["warmup_steps"] > 0 else None)
    parts = [whole]
    keys = [KeyPlan(whole, "compressed_key", f"{name}[0]", numel, torch.float32, key_params,
                    payload_bound(key_params, numel))]
    if params["warmup_steps"] > 0:
        for offset, length in partition(numel, 4, partition_bytes):
            part = Part(offset, length, only="warmup")
            parts.append(part)
            keys.append(KeyPlan(part, "raw_key", f"{name}[warmup {offset}]", length,
                                wire_dtype, None, length * wire_dtype.itemsize,
                                warmup_only=True))
    return parts, keys, None


def plan_buckets(names: list[str], small: dict[int, Part], wire_dtype: torch.dtype,
                 partition_bytes: int, numels: list[int]) -> tuple[list[KeyPlan], list[Bucket]]:
    """Key plans for the small tensors (``small``: tensor index -> its only part; ``names``
    and ``numels`` of all tensors in model order): in backward order they share buckets
    of up to ``partition_bytes`` on the wire, as DDP's buckets do, except that a bucket
    closes once more than ``partition_bytes`` of other gradients (counted in float32, as
    partitions are) came after its first member, so that no small gradient waits for
    much of the backward pass. One alone keeps a raw key of its own. Returns the plans
    and the buckets.

        >>> import torch
        >>> names, numels = ["w1", "b1", "w2", "b2", "w3", "b3"], [64, 8, 64, 8, 16, 8]
        >>> small = {i: Part(0, numels[i]) for i in (1, 3, 5)}
        >>> plans, buckets = plan_buckets(names, small, torch.float32, 256, numels)
        >>> [p.name for p in plans]  # w3's 64 bytes pass, w2's 256 more close the bucket
        ['fused(b3, b2)', 'b1[0]']
    """
    capacity = max(1, partition_bytes // wire_dtype.itemsize)
    runs: list[list[int]] = []
    run: list[int] | None = None  # the open bucket
    filled = 0  # elements in the open bucket
    passed = 0  # bytes of other gradients since its first member
    for index in reversed(range(len(names))):  # backward order
        if index not in small:
            passed += 4 * numels[index]
            if passed > partition_bytes:
                run = None
            continue
        if run is None or filled + small[index].length > capacity:
            run, filled, passed = [], 0, 0
            runs.append(run)
        run.append(index)
        filled += small[index].length
    plans, buckets = [], []
    for run in runs:
        if len(run) == 1:
            part = small[run[0]]
            plans.append(KeyPlan(part, "raw_key", f"{names[run[0]]}[0]", part.length,
                                 wire_dtype, None, part.length * wire_dtype.itemsize))
            continue
        numel = sum(small[i].length for i in run)
        bucket = Bucket("fused(" + ", ".join(names[i] for i in run) + ")", numel,
                        len(run), buffer=torch.zeros(numel, dtype=wire_dtype))
        buckets.append(bucket)
        offset = 0
        for i in run:
            small[i].bucket, small[i].bucket_offset = bucket, offset
            offset += small[i].length
        plans.append(KeyPlan(bucket, "key", bucket.name, numel, wire_dtype, None,
                             numel * wire_dtype.itemsize))
    return plans, buckets


def plan_batches(keys: list[KeyPlan]) -> tuple[list[KeyPlan], list[Bucket]]:
    """Whole tensors of one shape (two or more) whose compressor batches them
    (``WholeTensor.batches``: powersgd with ``batch_tensors_with_same_shape``) travel
    together on one key of shape (b, *shape), stacked in backward order (the reverse of
    ``keys``, as DDP's buckets hold them), like PyTorch's batched compression. Returns
    the key plans with those tensors' keys replaced by one per shape, and the batches
    (fused like raw buckets, after warmup)."""
    groups: dict[tuple, list[int]] = {}
    for index in reversed(range(len(keys))):
        plan = keys[index]
        if plan.field == "compressed_key" and _batches(plan.params):
            groups.setdefault(tuple(plan.params["shape"]), []).append(index)
    batched = {i for members in groups.values() if len(members) > 1 for i in members}
    plans = [plan for i, plan in enumerate(keys) if i not in batched]
    buckets = []
    for shape, members in groups.items():
        if len(members) < 2:
            continue
        size = math.prod(shape)
        parts = [keys[i].part for i in members]
        bucket = Bucket("batched(" + ", ".join(keys[i].name for i in members) + ")",
                        len(members) * size, len(members),
                        buffer=torch.zeros(len(members) * size))
        for position, part in enumerate(parts):
            part.bucket, part.bucket_offset = bucket, position * size
        params = dict(keys[members[0]].params, shape=[len(members), *shape])
        buckets.append(bucket)
        plans.append(KeyPlan(bucket, "key", bucket.name, bucket.numel, torch.float32, params,
                             payload_bound(params, bucket.numel)))
    return plans, buckets


def _batches(params: dict | None) -> bool:
    """Whether a compressed key of ``params`` is a whole tensor its compressor batches."""
    cls = None if params is None else compressor_class(params)
    return cls is not None and issubclass(cls, WholeTensor) and cls.batches(params)


def plan_key_servers(keys: list[KeyPlan], num_servers: int) -> list[int]:
    """A server for each key, balancing the bytes a step pushes (payload bounds for
    compressed keys): by raw bytes, a 2 MB partition that compresses to 40 KB would
    weigh as much as 50 small tensors that travel uncompressed. Keys that carry traffic
    only during warmup are balanced among themselves, on top of the raw keys that
    travel in both phases.

    Example::

        >>> part = Part(0, 512000)
        >>> keys = [KeyPlan(part, "compressed_key", "w[0]", 512000, torch.float32, {}, 40976),
        ...         KeyPlan(part, "raw_key", "b", 11000, torch.float16, None, 22000),
        ...         KeyPlan(part, "compressed_key", "w[1]", 512000, torch.float32, {}, 40976)]
        >>> plan_key_servers(keys, 2)
        [0, 0, 1]
    """
    steady = [i for i, k in enumerate(keys) if not k.warmup_only]
    warmup = [i for i, k in enumerate(keys) if k.warmup_only]
    servers = [0] * len(keys)
    plan = plan_servers([keys[i].wire_bytes for i in steady], num_servers)
    loads = [0] * num_servers
    for i, server in zip(steady, plan, strict=True):
        servers[i] = server
        if keys[i].params is None:
            loads[server] += keys[i].wire_bytes
    plan = plan_servers([keys[i].wire_bytes for i in warmup], num_servers, loads)
    for i, server in zip(warmup, plan, strict=True):
        servers[i] = server
    return servers
