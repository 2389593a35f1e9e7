"""The launcher's per-role helpers: ports and the environments of a node's processes."""

from __future__ import annotations

import doctest
import socket

import bps.launch.role
from bps.launch.role import free_ports, local_rank_envs


def test_ports_picked_together_are_distinct_and_bindable() -> None:
    ports = free_ports(32)
    assert len(set(ports)) == 32
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_ports_are_picked_where_no_other_process_draws_them() -> None:
    """Below the kernel's ephemeral range (outgoing connections, bind(0)) and below
    ZeroMQ's random binds (49152 up), so that nobody takes them before their bind."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = free_ports(64)
    assert all(1024 < p < min(low, 49152) for p in ports), ports


def test_a_node_meets_at_the_port_it_is_given() -> None:
    envs = local_rank_envs({"DMLC_WORKER_ID": "1", "DMLC_NUM_WORKER": "2"}, 3, 40123)
    assert [e["BPS_LOCAL_MASTER_PORT"] for e in envs] == ["40123"] * 3
    assert [e["RANK"] for e in envs] == ["3", "4", "5"]


def test_docstring_examples() -> None:
    assert doctest.testmod(bps.launch.role).failed == 0
