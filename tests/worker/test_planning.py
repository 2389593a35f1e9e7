"""The trainer's key plan: small tensors fused within a span, keys balanced over servers
by wire bytes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from bps.worker.partition import Placement, partition
from tests.harness.placement import optimal_max_load, plan_loads


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.booleans()), min_size=1, max_size=12),
       st.sampled_from([64, 160, 400]))
def test_small_tensors_fuse_greedily_within_a_span_of_other_gradients(
        tensors: list[tuple[int, bool]], partition_bytes: int) -> None:
    """In backward order, a bucket takes every next small tensor that fits its capacity,
    until more than a partition of other gradients (float32 bytes) came after its first
    member: the plan holds each small tensor once, keeps both bounds, and closes no
    bucket that the next small tensor could have joined."""
    import torch

    from bps.worker.planning import Part, plan_buckets

    numels = [numel for numel, _ in tensors]
    names = [f"t{i}" for i in range(len(tensors))]
    small = {i: Part(0, numel) for i, (numel, is_small) in enumerate(tensors) if is_small}
    capacity = partition_bytes // 2  # float16 elements
    plans, buckets = plan_buckets(names, small, torch.float16, partition_bytes, numels)
    groups = []  # tensor indices per key, in backward order
    for plan in plans:
        members = plan.name.removeprefix("fused(").removesuffix(")").split(", ")
        groups.append([int(m.removesuffix("[0]")[1:]) for m in members])
    assert sorted(i for g in groups for i in g) == sorted(small)
    assert len(buckets) == sum(len(g) > 1 for g in groups)
    for plan, group in zip(plans, groups, strict=True):  # members packed in their order
        if len(group) > 1:
            assert any(plan.part is b for b in buckets)
            assert plan.numel == sum(numels[i] for i in group)
            assert [small[i].bucket_offset for i in group] == list(
                itertools.accumulate([numels[i] for i in group[:-1]], initial=0))

    def between(first: int, last: int) -> int:  # other gradients' float32 bytes
        return 4 * sum(numels[j] for j in range(last + 1, first) if j not in small)

    for n, group in enumerate(groups):
        following = groups[n + 1] if n + 1 < len(groups) else None
        assert group == sorted(group, reverse=True)  # backward order
        assert sum(numels[i] for i in group) <= capacity or len(group) == 1
        assert between(group[0], group[-1]) <= partition_bytes
        if following is not None:  # the next small tensor could not have joined
            nxt = following[0]
            assert (sum(numels[i] for i in group) + numels[nxt] > capacity
                    or between(group[0], nxt) > partition_bytes)


def mlp_keys(compressed_bytes, warmup: bool = False) -> list:
    """The trainer's key plans for bench/slow_network.py's MLP (784-1100-1100-10, 2 MB
    partitions, fp16 raw keys): the two large weights compressed, the tensors under
    64 KB raw, with the last layer and the second bias fused (next to each other in
    backward order) and the first bias alone."""
    import torch

    from bps.worker.planning import KeyPlan, Part

    plans = []
    for numel in (784 * 1100, 1100 * 1100):
        for _, length in partition(numel, 4, 2048000):
            part = Part(0, length)
            if warmup:
                plans.append(KeyPlan(part, "raw_key", "", length, torch.float16, None,
                                      2 * length, warmup_only=True))
            plans.append(KeyPlan(part, "compressed_key", "", length, torch.float32, {},
                                  compressed_bytes(length)))
    for numel in (1100, 1100 + 1100 * 10 + 10):
        plans.append(KeyPlan(Part(0, numel), "raw_key", "", numel, torch.float16, None,
                              2 * numel))
    return plans


def test_plan_key_servers_balances_bytes_on_the_wire() -> None:
    from bps.worker.planning import plan_key_servers

    def topk(numel: int) -> int:  # docs/compression.md: k int32 indices and k float32 values
        return int(numel * 0.01) * 8 + 16

    keys = mlp_keys(topk)
    wire = [k.wire_bytes for k in keys]
    planned = max(plan_loads(wire, plan_key_servers(keys, 4), 4))
    assert planned <= optimal_max_load(wire, 4) * 4 / 3
    # placed by raw bytes in declaration order, the fused key (24 KB per push in fp16)
    # lands on a server that already holds a 512,000-weight partition
    by_raw = Placement(4)
    raw = [by_raw.place(i, k.numel * k.dtype.itemsize) for i, k in enumerate(keys)]
    assert max(plan_loads(wire, raw, 4)) > 1.1 * planned

    # with warmup, the raw keys of compressed partitions carry the first steps: balanced
    # on top of the raw keys every step uses
    keys = mlp_keys(topk, warmup=True)
    servers = plan_key_servers(keys, 4)
    steady = [i for i, k in enumerate(keys) if not k.warmup_only]
    assert [servers[i] for i in steady] == plan_key_servers([keys[i] for i in steady], 4)
    warm = [i for i, k in enumerate(keys) if k.params is None]  # what warmup steps push
    warm_sizes = [keys[i].wire_bytes for i in warm]
    warm_loads = plan_loads(warm_sizes, [servers[i] for i in warm], 4)
    assert max(warm_loads) <= optimal_max_load(warm_sizes, 4) * 4 / 3
