"""Log lines that a hostile or broken peer can trigger, at a bounded rate.

Usage::

    from bps.common.ratelimit import RateLimitedLog
    refusals = RateLimitedLog(logging.getLogger("bps.server"))
    refusals.warning("refused %s from %s: %s", op, peer, reason)

At most ``burst`` lines go out at once and then one per ``1 / rate`` seconds; the lines
dropped in between are counted, and the next line that goes out says how many.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """A token bucket in front of a logger (thread-safe)."""

    def __init__(self, logger: logging.Logger, rate: float = 5.0, burst: int = 20) -> None:
        self.logger = logger
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.dropped = 0
        self._lock = threading.Lock()

    def _take(self) -> int | None:
        """None: drop this line; else the number of lines dropped before it."""
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens < 1:
                self.dropped += 1
                return None
            self.tokens -= 1
            dropped, self.dropped = self.dropped, 0
            return dropped

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log unless over the rate; returns whether the line went out."""
        dropped = self._take()
        if dropped is None:
            return False
        if dropped:
            msg += f" ({dropped} similar lines suppressed)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, msg, *args)
