"""Which server process holds each server slot once the job runs, the spare servers
waiting, and the slots whose server died (``BPS_SPARE_SERVERS``; the scheduler's book,
no sockets).

A server slot is a server rank: the keys the workers placed on server i stay on slot i
whoever serves it. A server that dies leaves its slot vacant; the oldest spare waiting
takes it at once, or else the next server that registers (a server process restarted
with the same environment, whose ``BPS_SERVER_ID`` names the slot, or any other one).
A slot vacant for longer than the scheduler allows fails the job, naming the dead server.

    >>> table = ServerTable(servers=2, spares=1)
    >>> table.fill({0: b"s0", 1: b"s1"})
    >>> table.admit(b"s2", rank=-1)           # every slot held: it waits as a spare
    >>> table.vacate(1, "server 1 died", now=10.0)   # the spare takes slot 1 at once
    b's2'
    >>> table.holders[1], table.waiting
    (b's2', [])
    >>> table.vacate(0, "server 0 died", now=11.0) is None     # no spare left
    True
    >>> table.overdue(now=15.0, limit=3.0)
    (0, 'server 0 died', 4.0)
    >>> table.admit(b"s3", rank=0)            # a restart of server 0 takes its slot
    0
"""

from __future__ import annotations

from dataclasses import dataclass, field


class TableError(ValueError):
    """A server the table cannot take (the scheduler refuses its HELLO with this)."""


@dataclass
class ServerTable:
    """Slots, spares and vacancies of a job whose servers may be replaced; ``spares``:
    ``BPS_SPARE_SERVERS``, the spares that may wait at once (None: servers are never
    replaced, and this table holds nothing)."""

    servers: int
    spares: int | None
    holders: dict[int, bytes] = field(default_factory=dict)  # slot -> its server's identity
    waiting: list[bytes] = field(default_factory=list)  # spares, in registration order
    vacant: dict[int, tuple[str, float]] = field(default_factory=dict)  # slot -> why, since
    died: dict[int, str] = field(default_factory=dict)  # slot -> why its last server died

    @property
    def replaces(self) -> bool:
        """Whether a dead server is replaced (``BPS_SPARE_SERVERS`` is set)."""
        return self.spares is not None

    def fill(self, holders: dict[int, bytes]) -> None:
        """The slots as the rendezvous dealt them (every one held)."""
        self.holders = dict(holders)

    def spare(self, identity: bytes) -> None:
        """A server that waits as a spare; TableError where ``BPS_SPARE_SERVERS`` spares
        already wait (or servers are not replaced)."""
        if not self.replaces or len(self.waiting) >= self.spares:
            raise TableError(f"more servers than DMLC_NUM_SERVER={self.servers}"
                             + ("" if not self.replaces else
                                f" and BPS_SPARE_SERVERS={self.spares} spares"))
        self.waiting.append(identity)

    def admit(self, identity: bytes, rank: int) -> int | None:
        """A server that registers once the job runs: the slot it takes now (``rank``,
        its ``BPS_SERVER_ID``, where that slot is vacant; else the oldest vacancy, a
        spare's id too), or None where it waits as a spare (no slot is vacant);
        TableError where it cannot."""
        if not self.replaces:
            raise TableError("rendezvous already complete")
        if rank >= self.servers + self.spares:
            raise TableError(f"BPS_SERVER_ID={rank} out of range for DMLC_NUM_SERVER + "
                             f"BPS_SPARE_SERVERS")
        slot = rank if rank in self.vacant else min(
            self.vacant, key=lambda s: self.vacant[s][1], default=None)
        if slot is None:
            self.spare(identity)
            return None
        self.take(slot, identity)
        return slot

    def take(self, slot: int, identity: bytes) -> None:
        """``identity`` holds ``slot`` from now on."""
        del self.vacant[slot]
        if identity in self.waiting:
            self.waiting.remove(identity)
        self.holders[slot] = identity

    def vacate(self, slot: int, why: str, now: float) -> bytes | None:
        """Slot ``slot``'s server died (``why``): the spare that takes it now, or None
        (the slot waits for a server to register)."""
        self.holders.pop(slot, None)
        self.vacant[slot] = (why, now)
        self.died[slot] = why
        if not self.waiting:
            return None
        identity = self.waiting[0]
        self.take(slot, identity)
        return identity

    def drop_spare(self, identity: bytes) -> bool:
        """A spare that died; whether it was one."""
        if identity in self.waiting:
            self.waiting.remove(identity)
            return True
        return False

    def overdue(self, now: float, limit: float) -> tuple[int, str, float] | None:
        """A slot vacant for more than ``limit`` seconds: (slot, why it is vacant, how
        long), the oldest; None where there is none."""
        late = [(slot, why, now - since) for slot, (why, since) in self.vacant.items()
                if now - since > limit]
        return max(late, key=lambda item: item[2], default=None)
