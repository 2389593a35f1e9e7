"""Step timelines in the Chrome trace-event format, switched on as in BytePS.

With ``BYTEPS_TRACE_ON=1`` every process of a job (bpslaunch passes the environment on)
records what it does in steps ``BYTEPS_TRACE_START_STEP`` through
``BYTEPS_TRACE_END_STEP`` (default 10 to 20, both included; the end defaults to the start
where that is later) and writes
``BYTEPS_TRACE_DIR/<process>.json`` (default ``./traces``) when it shuts down:

* workers (``worker<node>``; ``worker<node>.<local rank>`` with several local ranks):
  ``compute`` (the end of the previous ``step()`` until this one is called), ``wait``
  (``step()`` waiting for the aggregates), ``update`` (``optimizer.step()``), an instant
  ``ready`` per gradient; on local rank 0, per partition: ``compress``, ``queued``
  (waiting for send credit), ``push`` (sent, until the server's ACK), ``aggregate`` (ACK
  until the reply: the other nodes' pushes, the server's sum and the transfer back) and
  ``decompress``;
* servers (``server<id>``): per partition ``sum`` (first push received until every node's
  push is added; its ``server_s``: the seconds of the ``decode`` spans and the
  ``compress`` span together, what the workers' stats count as ``server_time``),
  ``decode`` (one node's push decoded and added to the sum), ``compress`` (the sum, for
  the pull) and an instant ``push`` per node.

Timestamps are CLOCK_MONOTONIC, which every process of one machine shares (network
namespaces included), so the files of one ``bpslaunch local`` or ``bpslaunch netem`` job
line up. ``python -m bps.common.trace DIR`` merges them into ``DIR/timeline.json`` (open it in
ui.perfetto.dev or chrome://tracing) and prints, per process and kind, the milliseconds
of a step during which at least one such span ran; ``--step N`` also lists step N's
events of every process in time order.

Usage::

    BYTEPS_TRACE_ON=1 BYTEPS_TRACE_DIR=/tmp/traces bpslaunch local --workers 2 \\
        --servers 1 -- python examples/mnist.py --epochs 1 --compressor onebit --ef vanilla
    python -m bps.common.trace /tmp/traces

    >>> tracer = Tracer("worker0", first_step=1, last_step=2)
    >>> tracer.complete("compress", "fc.weight[0]", step=1, start_ns=1000, end_ns=3000)
    >>> tracer.complete("compress", "fc.weight[0]", step=3, start_ns=5000, end_ns=6000)
    >>> [(e["name"], e["ts"], e["dur"]) for e in tracer.chrome_events() if e["ph"] == "X"]
    [('compress fc.weight[0]', 1.0, 2.0)]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from bps.common.env import ClusterEnv

MERGED_NAME = "timeline.json"


class Tracer:
    """The events of one process for steps ``first_step`` through ``last_step``.

    Recording is an append to a list (thread-safe under the GIL); nothing is formatted
    or written before :meth:`save`.
    """

    def __init__(self, label: str, first_step: int, last_step: int,
                 directory: str | os.PathLike | None = None) -> None:
        self.label = label
        self.first_step, self.last_step = first_step, last_step
        self.directory = None if directory is None else Path(directory)
        self.pid = os.getpid()
        self._events: list[tuple] = []
        self._threads: dict[int, str] = {}

    def at(self, step: int) -> bool:
        """Whether ``step`` is one of the traced steps."""
        return self.first_step <= step <= self.last_step

    def complete(self, kind: str, name: str, step: int, start_ns: int, end_ns: int,
                 **args: object) -> None:
        """A span of ``kind`` (``compress``, ``push``...) for ``name`` (a partition, or
        empty), from ``start_ns`` to ``end_ns`` (``time.monotonic_ns()``)."""
        if self.at(step):
            self._events.append(("X", kind, name, step, start_ns, end_ns, self._tid(), args))

    def instant(self, kind: str, name: str, step: int, **args: object) -> None:
        """A point event now."""
        if self.at(step):
            now = time.monotonic_ns()
            self._events.append(("i", kind, name, step, now, now, self._tid(), args))

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self._threads:
            self._threads[tid] = threading.current_thread().name
        return tid

    def chrome_events(self) -> list[dict]:
        """The events as Chrome trace-event dicts (microseconds), metadata first."""
        events = [{"ph": "M", "name": "process_name", "pid": self.pid,
                   "args": {"name": self.label}}]
        events += [{"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid,
                    "args": {"name": name}} for tid, name in self._threads.items()]
        for ph, kind, name, step, start, end, tid, args in self._events:
            event = {"ph": ph, "cat": kind, "name": f"{kind} {name}" if name else kind,
                     "pid": self.pid, "tid": tid, "ts": start / 1000,
                     "args": {"step": step, "process": self.label, **args}}
            if ph == "X":
                event["dur"] = (end - start) / 1000
            else:
                event["s"] = "t"
            events.append(event)
        return events

    def save(self) -> Path | None:
        """Write ``<directory>/<label>.json`` (no-op without a directory)."""
        if self.directory is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.label}.json"
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps({"traceEvents": self.chrome_events(),
                                       "displayTimeUnit": "ms"}))
        partial.replace(path)
        return path


def from_env(env: ClusterEnv, label: str) -> Tracer | None:
    """The process's tracer where ``BYTEPS_TRACE_ON=1``."""
    if env.trace_dir is None:
        return None
    return Tracer(label, env.trace_first_step, env.trace_last_step, env.trace_dir)


def merge(directory: str | os.PathLike) -> tuple[Path, list[dict]]:
    """Merge every process's file in ``directory`` into ``timeline.json``."""
    directory = Path(directory)
    events: list[dict] = []
    files = sorted(p for p in directory.glob("*.json") if p.name != MERGED_NAME)
    if not files:
        raise FileNotFoundError(f"{directory}: no trace files (was BYTEPS_TRACE_ON=1 set "
                                "and did the job shut down cleanly?)")
    for path in files:
        try:
            events += json.loads(path.read_text())["traceEvents"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{path}: not a bps trace file: {exc}") from None
    out = directory / MERGED_NAME
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out, events


def covered_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of ``(start_us, end_us)`` spans.

    >>> covered_ms([(0, 2000), (1000, 3000), (5000, 6000)])
    4.0
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1000


def per_step_ms(events: list[dict]) -> dict[str, dict[str, float]]:
    """Per process and kind of span: the median over traced steps of the milliseconds
    during which at least one span of that kind ran (parallel partitions overlap)."""
    spans: dict[tuple[str, str], dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for event in events:
        if event.get("ph") == "X":
            args = event["args"]
            spans[(args["process"], event["cat"])][args["step"]].append(
                (event["ts"], event["ts"] + event["dur"]))
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for (process, kind), steps in sorted(spans.items()):
        table[process][kind] = statistics.median(covered_ms(s) for s in steps.values())
    return dict(table)


def step_listing(events: list[dict], step: int) -> list[str]:
    """One line per event of ``step`` in every process, by start time: start and end in
    milliseconds from the step's first event, the process and the event.

    >>> events = [{"ph": "X", "name": "push w[0]", "ts": 1500, "dur": 500,
    ...            "args": {"step": 4, "process": "worker0"}},
    ...           {"ph": "i", "name": "push w[0]", "ts": 1800,
    ...            "args": {"step": 4, "process": "server0", "node": 0}},
    ...           {"ph": "X", "name": "wait", "ts": 1000, "dur": 2000,
    ...            "args": {"step": 4, "process": "worker0"}}]
    >>> print("\\n".join(step_listing(events, 4)))
        0.0     2.0  worker0   wait
        0.5     1.0  worker0   push w[0]
        0.8          server0   push w[0] from node 0
    """
    chosen = sorted((e for e in events if e.get("ph") in ("X", "i")
                     and e["args"]["step"] == step), key=lambda e: e["ts"])
    if not chosen:
        return []
    origin = chosen[0]["ts"]
    lines = []
    for e in chosen:
        start = f"{(e['ts'] - origin) / 1000:7.1f}"
        end = f"{(e['ts'] + e['dur'] - origin) / 1000:7.1f}" if e["ph"] == "X" else " " * 7
        node = f" from node {e['args']['node']}" if "node" in e["args"] else ""
        lines.append(f"{start} {end}  {e['args']['process']:9s} {e['name']}{node}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bps.common.trace",
        description="Merge a job's BYTEPS_TRACE_DIR into timeline.json and summarise it.")
    parser.add_argument("directory", help="the job's BYTEPS_TRACE_DIR")
    parser.add_argument("--step", type=int, default=None,
                        help="also list every event of this step, all processes, by time")
    args = parser.parse_args(argv)
    try:
        out, events = merge(args.directory)
    except (OSError, ValueError) as exc:
        print(f"bps.common.trace: {exc}", file=sys.stderr)
        return 1
    table = per_step_ms(events)
    kinds = sorted({kind for row in table.values() for kind in row})
    print("median ms per traced step during which a span of each kind ran:")
    print("| process | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for process in sorted(table):
        cells = [f"{table[process][k]:.1f}" if k in table[process] else "" for k in kinds]
        print(f"| {process} | " + " | ".join(cells) + " |")
    print(f"written: {out} (open in ui.perfetto.dev or chrome://tracing)")
    if args.step is not None:
        lines = step_listing(events, args.step)
        if not lines:
            traced = sorted({e["args"]["step"] for e in events if "args" in e
                             and "step" in e["args"]})
            print(f"bps.common.trace: step {args.step} is not in the traces (traced steps: "
                  f"{traced[0]}-{traced[-1]})" if traced else
                  f"bps.common.trace: step {args.step} is not in the traces (no steps traced)",
                  file=sys.stderr)
            return 1
        print(f"\nstep {args.step}: start and end in ms from its first event")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
