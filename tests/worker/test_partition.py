"""Partitioning within the byte budget, and greedy least-loaded placement against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bps.worker.partition import Placement, partition, plan_servers
from tests.harness.placement import optimal_max_load, plan_loads


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**5), st.sampled_from([2, 4, 8]), st.integers(64, 10**5))
def test_partition_covers_tensor_within_budget(numel: int, itemsize: int, budget: int) -> None:
    parts = partition(numel, itemsize, budget)
    assert sum(length for _, length in parts) == numel
    assert all(o2 == o1 + n1 for (o1, n1), (o2, _) in zip(parts, parts[1:], strict=False))
    assert all(length * itemsize <= budget for _, length in parts)


def test_placement_is_greedy_least_loaded_and_deterministic() -> None:
    sizes = [400, 100, 100, 100, 300, 50, 50]
    placements = []
    for _ in range(2):
        placement = Placement(3)
        placements.append([placement.place(k, n) for k, n in enumerate(sizes)])
    assert placements[0] == placements[1] == [0, 1, 2, 1, 2, 1, 1]
    assert placement.loads == [400, 300, 400]
    assert placement.place(4, 300) == 2  # a placed key keeps its server
    placement.unplace(6, 50)
    assert placement.loads == [400, 250, 400] and 6 not in placement.servers


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=100), st.integers(1, 8))
def test_placement_balance_bound(sizes: list[int], servers: int) -> None:
    placement = Placement(servers)
    for key, nbytes in enumerate(sizes):
        placement.place(key, nbytes)
    if len(sizes) >= servers:
        assert max(placement.loads) - min(placement.loads) <= max(sizes)


def test_plan_servers_places_largest_first() -> None:
    # in declaration order the two small keys would take both servers and the large
    # one would land on top of one of them (largest load 30)
    assert plan_servers([10, 10, 20], 2) == [1, 1, 0]
    assert plan_servers([10, 10, 20], 2, loads=[0, 25]) == [0, 1, 0]
    assert plan_servers([], 3) == []
    with pytest.raises(ValueError, match="2 loads for 3 servers"):
        plan_servers([1], 3, loads=[0, 0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=7), st.integers(1, 3),
       st.lists(st.integers(0, 500), min_size=3, max_size=3))
def test_plan_servers_within_lpt_bound(sizes: list[int], servers: int, start: list[int]) -> None:
    start = start[:servers]
    plan = plan_servers(sizes, servers, start)
    assert plan == plan_servers(list(sizes), servers, list(start))  # deterministic
    assert all(0 <= s < servers for s in plan)
    largest = max(plan_loads(sizes, plan, servers, start))
    # Graham: LPT's largest load is at most 4/3 - 1/(3m) of the optimum (from a common
    # start, the same argument bounds it by the optimum plus a third of it)
    assert largest <= optimal_max_load(sizes, servers, start) * 4 / 3 + 1e-9
