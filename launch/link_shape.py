"""How the emulated links are shaped: rate, delay and loss, parsed and turned into tc args.

Every link direction gets the same :class:`LinkShape` (tbf for the rate, netem for
delay and loss; see :mod:`bps.launch.netns`)::

    >>> shape = LinkShape.parse(rate="100mbit", delay="1ms", loss="0.1%")
    >>> shape.describe()
    'rate 100mbit, delay 1ms, loss 0.1% per link direction'
    >>> shape.netem_args()
    ['netem', 'limit', '100000', 'delay', '1000us', 'loss', '0.1%']
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MTU_FRAME = 1514
HOST_QUEUE_FRAMES = 1000  # Linux's default txqueuelen
HOST_QUEUE_SECONDS = 1.0  # ... but never more than this much traffic


class NetnsError(RuntimeError):
    """The emulated network cannot be built or used (privileges, tools, kernel, bad spec)."""


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30}
_DELAY_UNITS = {"us": 1, "ms": 1000, "s": 1_000_000}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def parse_rate(text: str) -> int | None:
    """``"100mbit"`` -> 100_000_000 bit/s; ``"none"`` -> None (no rate limit).

    Units are tc's bit units (``bit kbit mbit gbit``, and ``kibit mibit gibit``).
    tc's byte units (``kbps``, ``mbps``: bytes per second) are refused because they
    are so often meant as bits.
    """
    value = text.strip().lower()
    if value in ("none", "off", "unlimited"):
        return None
    match = re.fullmatch(_NUMBER + r"\s*([a-z]+)", value)
    if match is None or match.group(2) not in _RATE_UNITS:
        hint = ""
        if match is not None and match.group(2).endswith("bps"):
            hint = (" (tc's 'bps' units mean bytes per second; write bits, "
                    "e.g. 100mbit for 100 megabits per second)")
        raise NetnsError(
            f"--rate: invalid value {text!r}{hint}; expected a number with a unit out of "
            f"{', '.join(_RATE_UNITS)} (e.g. 100mbit, 20mbit, 1gbit) or 'none'")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits < 8000:
        raise NetnsError(f"--rate: {text!r} is below the supported minimum of 8kbit")
    return int(bits)


def parse_delay(text: str) -> int:
    """``"1ms"`` -> 1000 microseconds; ``"0"`` -> 0. Units: ``us``, ``ms``, ``s``."""
    value = text.strip().lower()
    if re.fullmatch(r"0+(\.0*)?", value):
        return 0
    match = re.fullmatch(_NUMBER + r"\s*([a-z]+)", value)
    if match is None or match.group(2) not in _DELAY_UNITS:
        raise NetnsError(f"--delay: invalid value {text!r}; expected a number with a unit "
                         "out of us, ms, s (e.g. 1ms, 500us) or 0")
    micros = float(match.group(1)) * _DELAY_UNITS[match.group(2)]
    if micros > 10_000_000:
        raise NetnsError(f"--delay: {text!r} is more than the supported maximum of 10s")
    return int(round(micros))


def parse_loss(text: str) -> float:
    """``"0.5%"`` -> 0.5 (percent of packets dropped per link direction); ``"0"`` -> 0."""
    value = text.strip()
    match = re.fullmatch(_NUMBER + r"\s*(%?)", value)
    if match is None:
        raise NetnsError(f"--loss: invalid value {text!r}; expected a percentage in [0, 100) "
                         "such as 0%, 0.1% or 1%")
    percent = float(match.group(1))
    if not percent < 100.0:
        raise NetnsError(f"--loss: {text!r} must be below 100%")
    return percent


def format_rate(bits_per_second: int | None) -> str:
    """100_000_000 -> ``"100mbit"``; None -> ``"none"``."""
    if bits_per_second is None:
        return "none"
    for unit, factor in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second % factor == 0:
            return f"{bits_per_second // factor}{unit}"
    return f"{bits_per_second}bit"


@dataclass(frozen=True)
class LinkShape:
    """How every link direction is shaped: rate in bit/s (None: unlimited), delay, loss."""

    rate_bits: int | None
    delay_us: int = 0
    loss_percent: float = 0.0

    @classmethod
    def parse(cls, rate: str, delay: str = "0ms", loss: str = "0%") -> LinkShape:
        return cls(parse_rate(rate), parse_delay(delay), parse_loss(loss))

    @property
    def needs_netem(self) -> bool:
        return self.delay_us > 0 or self.loss_percent > 0

    def tbf_args(self, host_side: bool = False) -> list[str]:
        """tbf parameters sized so the long-term rate is exact at any rate.

        burst: about 2 ms of traffic but at least a few frames (GSO super-packets
        larger than the bucket are segmented by tbf, not dropped). limit, on the
        switch side: about 50 ms of queue, so a few TCP flows meeting on one link
        (incast) keep the link busy instead of losing packets to a tiny buffer. On
        the host side (``host_side``, what the host sends) at least a NIC's transmit
        queue of HOST_QUEUE_FRAMES: a host queues what its own sockets send rather than
        drop it. 50 ms alone is 125 KB at 20 Mbit/s, less than one topk step's pushes
        of the slow-network job, and those local drops cost retransmission timeouts
        (a median step of 395 ms instead of 192 ms). That queue holds at most 1 s of
        traffic (HOST_QUEUE_SECONDS), so at very low rates a full queue cannot hold a
        heartbeat back for longer than the failure detector waits.
        """
        assert self.rate_bits is not None
        rate_bytes = self.rate_bits / 8
        burst = max(4 * _MTU_FRAME, int(rate_bytes * 0.002))
        queue = max(32 * _MTU_FRAME, int(rate_bytes * 0.05))
        if host_side:
            nic_queue = min(HOST_QUEUE_FRAMES * _MTU_FRAME, int(rate_bytes * HOST_QUEUE_SECONDS))
            queue = max(queue, nic_queue)
        limit = burst + queue
        return ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst),
                "limit", str(limit)]

    def netem_args(self) -> list[str]:
        args = ["netem", "limit", "100000"]
        if self.delay_us:
            args += ["delay", f"{self.delay_us}us"]
        if self.loss_percent:
            args += ["loss", f"{self.loss_percent}%"]
        return args

    def describe(self) -> str:
        parts = [f"rate {format_rate(self.rate_bits)}"]
        if self.delay_us:
            parts.append(f"delay {self.delay_us / 1000:g}ms")
        if self.loss_percent:
            parts.append(f"loss {self.loss_percent:g}%")
        return ", ".join(parts) + " per link direction"
