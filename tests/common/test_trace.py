"""Timelines (bps.common.trace): the Chrome trace format, the step window, the environment, and
a real cluster's files, whose stages must line up across processes."""

from __future__ import annotations

import doctest
import itertools
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import bps.common.trace
from bps.common.env import ClusterEnv, EnvError
from bps.common.striping import host_cores
from bps.common.trace import Tracer, covered_ms, per_step_ms
from tests.harness.trainer_job import launch, load_reports

BASE_ENV = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "DMLC_NUM_WORKER": "2",
            "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000"}


def in_order(*times_us: float) -> bool:
    """Non-decreasing, up to the rounding of nanoseconds written as float microseconds."""
    return all(a <= b + 1e-3 for a, b in itertools.pairwise(times_us))


def test_module_examples() -> None:
    result = doctest.testmod(bps.common.trace)
    assert result.attempted >= 4 and result.failed == 0


def test_tracer_keeps_its_steps_and_writes_chrome_events(tmp_path: Path) -> None:
    tracer = Tracer("server3", first_step=2, last_step=3, directory=tmp_path / "t")
    for step in range(1, 5):
        tracer.complete("sum", "w[0]", step, start_ns=step * 10_000, end_ns=step * 10_000 + 2500,
                        bytes=step)
        tracer.instant("push", "w[0]", step, node=1)
    path = tracer.save()
    assert path == tmp_path / "t" / "server3.json"
    events = json.loads(path.read_text())["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    assert {"ph": "M", "name": "process_name", "pid": tracer.pid,
            "args": {"name": "server3"}} in meta
    assert any(e["name"] == "thread_name" for e in meta)
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["args"]) for e in spans] == [
        ("sum w[0]", 20.0, 2.5, {"step": 2, "process": "server3", "bytes": 2}),
        ("sum w[0]", 30.0, 2.5, {"step": 3, "process": "server3", "bytes": 3})]
    instants = [e for e in events if e["ph"] == "i"]
    assert [(e["args"]["step"], e["args"]["node"]) for e in instants] == [(2, 1), (3, 1)]
    assert not list(tmp_path.glob("t/*.partial"))


def test_per_step_ms_takes_the_union_of_overlapping_spans() -> None:
    def span(kind: str, step: int, start_us: float, end_us: float) -> dict:
        return {"ph": "X", "cat": kind, "ts": start_us, "dur": end_us - start_us,
                "args": {"step": step, "process": "worker0"}}

    events = [span("push", 1, 0, 4000), span("push", 1, 1000, 2000),   # nested: 4 ms
              span("push", 2, 0, 1000), span("push", 2, 3000, 5000),   # disjoint: 3 ms
              span("push", 3, 0, 6000),                                 # 6 ms
              span("wait", 1, 0, 1500), {"ph": "i", "cat": "push", "ts": 0,
                                         "args": {"step": 1, "process": "worker0"}}]
    assert per_step_ms(events) == {"worker0": {"push": 4.0, "wait": 1.5}}
    assert covered_ms([(5, 6), (0, 1), (0.5, 2)]) == pytest.approx(0.003)


def test_environment_turns_tracing_on_and_checks_the_steps(tmp_path: Path) -> None:
    off = ClusterEnv.from_environ(BASE_ENV)
    assert off.trace_dir is None
    on = ClusterEnv.from_environ({**BASE_ENV, "BYTEPS_TRACE_ON": "1",
                                  "BYTEPS_TRACE_DIR": str(tmp_path / "tr")})
    assert (on.trace_dir, on.trace_first_step, on.trace_last_step) == (
        str(tmp_path / "tr"), 10, 20)
    late = ClusterEnv.from_environ({**BASE_ENV, "BYTEPS_TRACE_ON": "1",
                                    "BYTEPS_TRACE_START_STEP": "30"})
    assert (late.trace_first_step, late.trace_last_step) == (30, 30)
    bad = [({"BYTEPS_TRACE_ON": "yes"}, "BYTEPS_TRACE_ON='yes'"),
           ({"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_START_STEP": "5",
             "BYTEPS_TRACE_END_STEP": "4"}, "BYTEPS_TRACE_END_STEP=4 is before"),
           ({"BYTEPS_TRACE_START_STEP": "-1"}, "BYTEPS_TRACE_START_STEP=-1 out of range")]
    for extra, fragment in bad:
        with pytest.raises(EnvError, match=fragment):
            ClusterEnv.from_environ({**BASE_ENV, **extra})


def test_cluster_timeline_lines_up_across_processes(tmp_path: Path) -> None:
    params = {"compressor": "topk", "k": 0.25, "ef": "vanilla", "momentum": "nesterov",
              "fp16": False, "min_compress_bytes": 1000}
    traces = tmp_path / "traces"
    result = launch({"runs": [{"params": params}], "lrs": [0.1] * 5, "stop": 5}, tmp_path,
                    workers=2, servers=2,
                    env={"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_DIR": str(traces),
                         "BYTEPS_TRACE_START_STEP": "1", "BYTEPS_TRACE_END_STEP": "3"})
    assert result.returncode == 0, result.stdout[-3000:]
    # no BPS_SERVER_THREADS: the launcher shares the cores by the job's 4 processes
    assert result.stdout.count(f"engine threads: {max(1, host_cores() // 4)}\n") == 2
    files = sorted(p.name for p in traces.glob("*.json"))
    assert files == ["server0.json", "server1.json", "worker0.json", "worker1.json"]

    spans: dict[tuple, list] = defaultdict(list)  # (process, kind, name, step) -> spans
    instants: dict[tuple, list] = defaultdict(list)
    server_seconds: dict[tuple, list] = defaultdict(list)  # (server, name, step) -> sum's
    for path in traces.glob("*.json"):
        for e in json.loads(path.read_text())["traceEvents"]:
            if e["ph"] == "M":
                continue
            key = (path.stem, e["cat"], e["name"].partition(" ")[2], e["args"]["step"])
            if e["ph"] == "X":
                spans[key].append((e["ts"], e["ts"] + e["dur"]))
                if e["cat"] == "sum":
                    server_seconds[(path.stem, key[2], key[3])].append(e["args"]["server_s"])
            else:
                instants[key].append(e["args"])
    assert {key[3] for key in spans} == {1, 2, 3}

    # "big" (300 floats, BYTEPS_PARTITION_BYTES=400) is compressed in 3 partitions of 100
    partitions = [f"big[{i}]" for i in range(3)]
    for worker in ("worker0", "worker1"):
        for step in (1, 2, 3):
            (compute,), (wait,), (update,) = (spans[(worker, k, "", step)]
                                              for k in ("compute", "wait", "update"))
            assert in_order(*compute, *wait, *update)
            for name in partitions:
                stages = [spans[(worker, kind, name, step)] for kind in
                          ("compress", "queued", "push", "aggregate", "decompress")]
                assert all(len(s) == 1 for s in stages), (worker, name, step, stages)
                bounds = [t for (span,) in stages for t in span]
                assert in_order(compute[0], *bounds, wait[1]), (worker, name, step, bounds)
            ready = instants[(worker, "ready", "big", step)]
            assert len(ready) == 1

    # a server sums a partition after some worker sent it, and every worker's reply
    # arrives after the server compressed the sum: one clock for all processes
    for name in partitions:
        holders = {p for (p, kind, n, _) in spans if kind == "sum" and n == name}
        assert len(holders) == 1 and holders <= {"server0", "server1"}, (name, holders)
        (server,) = holders
        for step in (1, 2, 3):
            (summed,) = spans[(server, "sum", name, step)]
            (compressed,) = spans[(server, "compress", name, step)]
            pushed = [spans[(w, "push", name, step)][0] for w in ("worker0", "worker1")]
            replied = [spans[(w, "aggregate", name, step)][0] for w in ("worker0", "worker1")]
            assert in_order(min(p[0] for p in pushed), *summed, *compressed,
                            min(r[1] for r in replied)), (server, name, step)
            nodes = sorted(a["node"] for a in instants[(server, "push", name, step)])
            assert nodes == [0, 1]
            decoded = spans[(server, "decode", name, step)]
            assert len(decoded) == 2 and all(in_order(summed[0], *span, summed[1])
                                             for span in decoded), (server, name, step)
            # the server's time: its decode spans and its compress span, nothing else
            busy_us = sum(end - start for start, end in [*decoded, compressed])
            (seconds,) = server_seconds[(server, name, step)]
            assert seconds * 1e6 == pytest.approx(busy_us, abs=0.01), (server, name, step)

    # each worker's stats() count, per step, the server time of every partition it pushed
    reports = load_reports(tmp_path, 2)
    for step in (1, 2, 3):
        total = sum(seconds for (_, _, step_), values in server_seconds.items()
                    if step_ == step for seconds in values)
        assert total > 0
        for report in reports:
            assert report[""]["steps"][step]["server_time"] == pytest.approx(total, rel=1e-9)

    merged = subprocess.run([sys.executable, "-m", "bps.common.trace", str(traces)],
                            capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr
    for process in ("server0", "server1", "worker0", "worker1"):
        assert f"| {process} |" in merged.stdout
    timeline = json.loads((traces / "timeline.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in timeline) == sum(len(v) for v in spans.values())

    listed = subprocess.run([sys.executable, "-m", "bps.common.trace", str(traces), "--step", "2"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.split("step 2: start and end in ms from its first event\n")[1]
    # fixed columns: start, end (blank for instants), process, event
    rows = [(line[:7].strip(), line[8:15].strip(), line[17:26].strip(), line[27:])
            for line in lines.splitlines()]
    starts = [float(row[0]) for row in rows]
    assert starts[0] == 0.0 and starts == sorted(starts)
    events_of_step_2 = sum(len(v) for k, v in spans.items() if k[3] == 2) + sum(
        len(v) for k, v in instants.items() if k[3] == 2)
    assert len(rows) == events_of_step_2
    assert ("worker0", "compress big[0]") in [row[2:] for row in rows]
    assert any(row[2].startswith("server") and row[3] == "push big[1] from node 1"
               for row in rows)
    missing = subprocess.run([sys.executable, "-m", "bps.common.trace", str(traces), "--step", "7"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1
    assert "step 7 is not in the traces (traced steps: 1-3)" in missing.stderr


def test_merge_of_an_empty_directory_says_what_is_missing(tmp_path: Path) -> None:
    merged = subprocess.run([sys.executable, "-m", "bps.common.trace", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert merged.returncode == 1
    assert "no trace files" in merged.stderr and "BYTEPS_TRACE_ON=1" in merged.stderr
