"""``use_batch_policy``: every thread of the process, those running already and those
started afterwards, runs under Linux's SCHED_BATCH; off, nothing changes. Each case in a
process of its own (a policy, once set, stays with the thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")

POLICIES = """
import json, os, sys, threading
from bps.common.cpu_policy import use_batch_policy

names = {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_BATCH: "SCHED_BATCH"}
release = threading.Event()
seen = {}

def record(name):
    seen[name] = names[os.sched_getscheduler(threading.get_native_id())]
    release.wait(30)  # still running when the policy is set

earlier = threading.Thread(target=record, args=("before",))
earlier.start()
done = use_batch_policy(sys.argv[1] == "on")
seen["before, now"] = names[os.sched_getscheduler(earlier.native_id)]
later = threading.Thread(target=record, args=("after",))
later.start()
release.set()
earlier.join(30)
later.join(30)
print(json.dumps({"done": done, "main": names[os.sched_getscheduler(0)], **seen}))
"""


def policies(switch: str) -> dict:
    result = subprocess.run([sys.executable, "-c", POLICIES, switch], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_batch_policy_reaches_every_thread_of_the_process() -> None:
    assert policies("on") == {"done": True, "main": "SCHED_BATCH", "before": "SCHED_OTHER",
                              "before, now": "SCHED_BATCH", "after": "SCHED_BATCH"}


def test_off_the_policy_stays_the_default() -> None:
    assert policies("off") == {"done": False, "main": "SCHED_OTHER", "before": "SCHED_OTHER",
                               "before, now": "SCHED_OTHER", "after": "SCHED_OTHER"}
