"""One lock between the test processes that start ``bpslaunch netem`` runs: the start of
every run removes the namespaces a dead run left (``clean_stale``), so a test that leaves
them for its own next run to remove holds it alone.

Example::

    with netem_runs(exclusive=True):  # no other test process starts a run meanwhile
        ...
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "bps-tests-netem-runs.lock"


@contextlib.contextmanager
def netem_runs(exclusive: bool = False, timeout: float = 240) -> Iterator[None]:
    """Hold the lock, shared (a test that starts runs) or ``exclusive`` (a test that
    leaves a dead run's namespaces); waits up to ``timeout`` s for it."""
    with open(LOCK, "a") as handle:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, mode)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, \
                    f"{LOCK} still held by another test process after {timeout:g} s"
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
