"""Where the node agent's CPU goes, stage by stage: thread CPU clocks around its calls.

Usage::

    python bench/agent_stages.py                      # 74 x Linear(256, 256), 300 steps
    python bench/agent_stages.py --steps 100 -- --layers 8 --width 128

Runs ``bench/key_overhead.py --rounds 1 --only "host, node agent"`` (the arguments after
``--`` go to it) with a ``sitecustomize`` first on ``PYTHONPATH``: in the node agent's
process only, it wraps the calls of :data:`STAGES` in ``time.thread_time_ns()`` and
counts the agent's steps (``_NodePipe.step_done``). The table gives each stage's calls
a step and its CPU per call and per step, inclusive (a stage's time holds the stages
it calls: a compressed key's push holds its chain, which holds onebit's kernel calls).
Each wrapped call adds two clock reads (about 1 us); calls on numba's warm-up thread
(``bps-kernel-load``) are not counted. The key_overhead table and its JSON (``--json``)
come too. Linux only (``/proc``); a ``sitecustomize`` of the environment's own is
shadowed meanwhile.

The host's load moves every figure here from one half hour to the next: compare two
builds by turns, or by a stage's ratio to a stage that did not change (the chains'
kernels) in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

# (module, class, method, what it is); "__main__" is the agent's own module
STAGES = [
    ("__main__", "_NodePipe", "arrive", "a compressed key pushed: its chain, queued"),
    ("bps.worker.codec_pool", "CodecPool", "_run_chain", "its chain: the kernels and their calls"),
    ("bps.compressors.onebit", "OneBit", "compress_with_error",
     "onebit's two passes over it and the error (numba)"),
    ("bps.worker.io_loop", "IOLoop", "enqueue", "a push queued for its server"),
    ("bps.worker.io_loop", "IOLoop", "flush", "the queued pushes sent (after each frame)"),
    ("__main__", "_NodePipe", "arrive_fused", "a bucket's members: division, cast, push"),
    ("bps.worker.io_loop", "IOLoop", "_receive_reply", "a server's message (ACK or aggregate)"),
    ("bps.worker.codec_pool", "CodecPool", "_decompress", "an aggregate decoded into .grad"),
    ("bps.compressors.onebit", "OneBit", "decompress", "onebit's parse and decoding pass (numba)"),
    ("bps.core.grad_pipeline", "GradPipeline", "_land", "a parameter landed"),
    ("bps.core.grad_pipeline", "GradPipeline", "_land_fused", "a bucket's members landed"),
]
STEP = ("__main__", "_NodePipe", "step_done")

SITECUSTOMIZE = '''
import importlib, json, os, sys, threading, time

if b"bps.core.pipeline_agent" in open("/proc/self/cmdline", "rb").read().split(b"\\0"):
    _TOTALS = {}
    _LOCK = threading.Lock()  # codec threads and the I/O thread may time one stage at once
    _STAGES = %(stages)r
    _OUT = %(out)r

    def _dump(snapshot=None):
        if snapshot is None:
            with _LOCK:
                snapshot = {name: list(total) for name, total in _TOTALS.items()}
        with open(_OUT + ".tmp", "w") as f:
            json.dump(snapshot, f)
        os.replace(_OUT + ".tmp", _OUT)

    def _wrap(owner, attr, name, after=None):
        raw = owner.__dict__[attr]
        function = raw.__func__ if isinstance(raw, staticmethod) else raw
        clock = time.thread_time_ns

        def timed(*args, **kwargs):
            if threading.current_thread().name == "bps-kernel-load":
                return function(*args, **kwargs)  # numba's warm-up on throwaway chains
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent = clock() - start
                with _LOCK:
                    total = _TOTALS.setdefault(name, [0, 0])
                    total[0] += spent
                    total[1] += 1
                if after is not None:
                    after()
        setattr(owner, attr, staticmethod(timed) if isinstance(raw, staticmethod) else timed)

    def _install():
        while not hasattr(sys.modules.get("__main__"), "_NodePipe"):
            time.sleep(0.01)
        try:
            for module, owner, attr in _STAGES:
                source = sys.modules["__main__"] if module == "__main__" \\
                    else importlib.import_module(module)
                _wrap(getattr(source, owner), attr, owner + "." + attr)
            # the totals so far, whenever the training process closes the agent
            _wrap(importlib.import_module("bps.worker.agent").Agent, "call_close", "close",
                  _dump)
        except Exception as exc:  # a call renamed or moved: say which
            _dump({"error": f"{type(exc).__name__}: {exc}"})

    threading.Thread(target=_install, daemon=True, name="bps-stage-clocks").start()
'''


def stage_table(totals: dict[str, list[int]]) -> str:
    """The stages' rows from ``{"Class.method": [ns, calls]}``, per agent step.

        >>> print(stage_table({"_NodePipe.step_done": [0, 2], "_NodePipe.arrive": [600_000, 6]}))
        | stage | calls a step | us a call | ms a step |
        |---|---:|---:|---:|
        | a compressed key pushed: its chain, queued (`_NodePipe.arrive`) | 3.0 | 100.0 | 0.30 |
    """
    steps = totals.get(f"{STEP[1]}.{STEP[2]}", [0, 0])[1]
    rows = ["| stage | calls a step | us a call | ms a step |", "|---|---:|---:|---:|"]
    for _, owner, attr, what in STAGES:
        ns, calls = totals.get(f"{owner}.{attr}", [0, 0])
        if not calls or not steps:
            continue
        rows.append(f"| {what} (`{owner}.{attr}`) | {calls / steps:.1f} | "
                    f"{ns / calls / 1e3:.1f} | {ns / steps / 1e6:.2f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps (default 300)")
    p.add_argument("rest", nargs="*", help="after --: more arguments of key_overhead.py")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "stages.json")
        stages = [stage[:3] for stage in STAGES] + [STEP]
        Path(tmp, "sitecustomize.py").write_text(
            textwrap.dedent(SITECUSTOMIZE) % {"stages": stages, "out": out})
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, str(Path(__file__).with_name("key_overhead.py")), "--rounds",
               "1", "--only", "host, node agent", "--steps", str(args.steps), *args.rest]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"key_overhead.py failed (exit {done.returncode}):\n"
                             f"{(done.stdout + done.stderr)[-3000:]}")
        totals = json.loads(Path(out).read_text())
        if "error" in totals:
            raise SystemExit(f"could not time the agent's calls: {totals['error']}")
        print(done.stdout)
        print("The node agent's stages, thread CPU, inclusive:\n")
        print(stage_table(totals))


if __name__ == "__main__":
    main()
