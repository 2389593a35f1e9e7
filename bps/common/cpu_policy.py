"""bps's own processes let the training loop keep its core: Linux's ``SCHED_BATCH``.

A node agent or a server is woken by every message. Under the default policy the kernel
favours a thread that wakes, so on a host whose cores they share it often takes the core
from the training process at once: a backward pass is cut into slices, each hook may wait
for a core, and every switch costs both sides their caches. ``SCHED_BATCH`` (sched(7))
keeps the fair share of CPU time and gives up only that preference at wake-up; the woken
thread runs when the scheduler next turns, not in the middle of the training process's
slice. Every thread of the process takes it: those running already and, as Linux's
threads inherit their creator's policy, those started afterwards (ZeroMQ's, the engine's).

Node agents use it, and so do the servers of a job with node agents
(``bps.server.role.server_batch_policy``); ``BPS_SCHED_BATCH=0`` keeps the default
policy. Elsewhere than Linux nothing changes.

    >>> use_batch_policy(False)  # off: every thread keeps its policy
    False
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

__all__ = ["use_batch_policy"]


def use_batch_policy(enabled: bool) -> bool:
    """Put every thread of this process under ``SCHED_BATCH`` where ``enabled`` and the
    system has it (the threads started afterwards inherit it); returns whether it did."""
    if not enabled or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        # Linux sets a policy per thread: the ones already running (an import's) too
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(task), os.SCHED_BATCH, os.sched_param(0))
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    except OSError as exc:  # a container's seccomp profile may refuse it: run as before
        log.warning("could not set SCHED_BATCH (BPS_SCHED_BATCH=0 silences this): %s", exc)
        return False
    return True
