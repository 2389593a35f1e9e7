"""How long Python's garbage collector runs in each process of a job.

Usage (from the repository root)::

    PYTHONPATH=bench/gc_probe .venv/bin/bpslaunch local --workers 2 --servers 1 -- \\
        .venv/bin/python examples/mnist.py --compressor onebit --ef vanilla --momentum nesterov

Python imports ``sitecustomize`` at start-up, so every process of the job started with
this folder on its path prints one line to stderr as it exits: the milliseconds its
collections took, their count per generation, and the process's CPU seconds. Roles that
leave through ``os._exit`` (servers, the scheduler) print it too.
"""

import gc
import os
import sys
import time

_collections = [0, 0, 0]
_seconds = 0.0
_started = 0.0


def _time_collections(phase: str, info: dict) -> None:
    global _seconds, _started
    if phase == "start":
        _started = time.perf_counter()
    else:
        _seconds += time.perf_counter() - _started
        _collections[info["generation"]] += 1


def _report() -> None:
    sys.stderr.write(f"gc probe: pid {os.getpid()} ({' '.join(sys.argv)[:60]}): "
                     f"{_seconds * 1e3:.0f} ms in {sum(_collections)} collections (per "
                     f"generation {_collections}), {time.process_time():.1f} CPU s\n")
    sys.stderr.flush()


def _exit_reporting(code: int, _exit=os._exit) -> None:
    _report()
    _exit(code)


gc.callbacks.append(_time_collections)
os._exit = _exit_reporting
__import__("atexit").register(_report)
