"""The scheduler's book of server slots (``bps.server.server_table``), without sockets:
who takes a vacant slot (the oldest spare; else a server registering with the slot's id,
else any other one, a spare's id too), how many spares may wait, and which vacancy is
overdue."""

from __future__ import annotations

import pytest

from bps.server.server_table import ServerTable, TableError


def running(spares: int | None = 1) -> ServerTable:
    table = ServerTable(servers=3, spares=spares)
    table.fill({0: b"a", 1: b"b", 2: b"c"})
    return table


def test_spares_take_vacant_slots_oldest_spare_first() -> None:
    table = running(spares=2)
    assert table.admit(b"s1", rank=-1) is None and table.admit(b"s2", rank=4) is None
    assert table.waiting == [b"s1", b"s2"]
    assert table.vacate(2, "server 2 died", now=1.0) == b"s1"
    assert table.vacate(0, "server 0 died", now=2.0) == b"s2"
    assert table.holders == {0: b"s2", 1: b"b", 2: b"s1"} and not table.vacant
    assert table.vacate(1, "server 1 died", now=3.0) is None
    assert table.holders == {0: b"s2", 2: b"s1"} and 1 in table.vacant


def test_a_late_server_takes_its_own_slot_else_the_oldest_vacancy() -> None:
    table = running(spares=0)
    table.vacate(2, "server 2 died", now=1.0)
    table.vacate(0, "server 0 died", now=2.0)
    assert table.admit(b"r0", rank=0) == 0  # its own id, though not the oldest
    assert table.admit(b"x", rank=-1) == 2  # no id: the oldest vacancy
    assert table.holders == {0: b"r0", 1: b"b", 2: b"x"}
    table.vacate(1, "server 1 died", now=3.0)
    assert table.admit(b"y", rank=2) == 1  # its own slot is held: the vacant one


def test_spares_beyond_the_count_and_out_of_range_ids_are_refused() -> None:
    table = running(spares=1)
    table.admit(b"s1", rank=-1)
    with pytest.raises(TableError, match="more servers than DMLC_NUM_SERVER=3 and "
                                         "BPS_SPARE_SERVERS=1 spares"):
        table.admit(b"s2", rank=-1)
    with pytest.raises(TableError, match="BPS_SERVER_ID=4 out of range"):
        table.admit(b"s3", rank=4)
    assert table.drop_spare(b"s1") and not table.drop_spare(b"s1")
    assert table.admit(b"s2", rank=3) is None  # no slot is vacant: it waits


def test_a_spare_registering_late_takes_the_oldest_vacancy() -> None:
    table = running(spares=1)
    table.vacate(1, "server 1 died", now=1.0)
    table.vacate(0, "server 0 died", now=2.0)
    assert table.admit(b"s", rank=3) == 1  # a restarted spare: the slot vacant longest
    assert table.holders == {1: b"s", 2: b"c"} and list(table.vacant) == [0]


def test_without_spare_servers_nothing_is_replaced() -> None:
    table = running(spares=None)
    assert not table.replaces
    with pytest.raises(TableError, match="rendezvous already complete"):
        table.admit(b"x", rank=0)
    with pytest.raises(TableError, match="more servers than DMLC_NUM_SERVER=3$"):
        table.spare(b"x")


def test_the_longest_vacancy_past_the_limit_is_overdue() -> None:
    table = running(spares=0)
    table.vacate(1, "server 1 died", now=10.0)
    table.vacate(2, "server 2 died", now=11.0)
    assert table.overdue(now=13.0, limit=3.0) is None
    assert table.overdue(now=14.5, limit=3.0) == (1, "server 1 died", 4.5)
    table.admit(b"r1", rank=1)
    assert table.overdue(now=14.5, limit=3.0) == (2, "server 2 died", 3.5)
