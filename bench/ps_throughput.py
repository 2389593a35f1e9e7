"""Parameter-server throughput: bps push/pull against raw ZeroMQ, same run, same sockets.

Usage::

    .venv/bin/python bench/ps_throughput.py [--mbytes 100] [--steps 5]

2 worker processes and 1 server on loopback; every step each worker pushes ``--mbytes``
MB of float32 in partitions of BYTEPS_PARTITION_BYTES (default 4,096,000) and pulls the same
amount back. The baseline moves exactly the same messages between the same kind of
sockets (DEALER workers, a ROUTER server) with no processing: the server echoes every
message at once. The ratio is baseline step time / bps step time (target >= 0.7), best
of ``--rounds`` alternating rounds of each.
bps runs twice in every round: authenticated and encrypted (CURVE, the default) and with
``BPS_INSECURE=1``; the baseline echo runs both ways too. Targets: bps with CURVE >= 0.5
of the plain-TCP baseline; compressed jobs with CURVE within 5% of without.
Then the same job with onebit and with topk 1%: step time and wire bytes per step.
Results go to stdout (a markdown table) and bench/results/ps_throughput.json.

``--striping``: instead, bps uncompressed with N = 1, 2, 4, ... connections per
worker-server pair (``BPS_CONNECTIONS_PER_SERVER``, up to the host's cores), CURVE and
plain TCP, against the raw ZeroMQ echo (one connection per worker) in the same run;
best of ``--rounds`` alternating rounds; to bench/results/ps_striping.json. The last
two columns are the CPU seconds of each ZeroMQ I/O thread of the server and of worker
0 (its scheduler link's first): how evenly the connections' CURVE work was spread.
``--quick`` (1 round, 3 steps, 50 MB) keeps it under 3 minutes on a 16-core host::

    python bench/ps_throughput.py --striping --quick

``--cpu``: instead, the CPU time (user + system, every process of the job) per step of
each configuration, from two runs of ``--steps`` and ``4 * --steps`` steps (the
difference over the extra steps, so start-up cancels out); alternating, median of
``--rounds``; to bench/results/ps_cpu.json. On a host shared with other jobs this moves much
less than step times, and CPU time / 2 bounds what a step can take on 2 idle cores::

    .venv/bin/python bench/ps_throughput.py --cpu --rounds 3 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PARTITION_BYTES = 4096000
WARMUP_STEPS = 2
RAW_TIMEOUT_S = 60  # no echo for this long: the baseline fails instead of hanging


def partitions(mbytes: int) -> list[int]:
    """Element counts of the float32 partitions of one step."""
    total = mbytes * 1_000_000 // 4
    per = int(os.environ.get("BYTEPS_PARTITION_BYTES", PARTITION_BYTES)) // 4
    return [min(per, total - start) for start in range(0, total, per)]


# ---------------------------------------------------------------------- raw ZeroMQ

def raw_server(messages: int, key_file: str) -> None:
    """ROUTER echo: every message goes straight back to its sender, zero-copy. Binds a
    free port itself and prints it, so no other socket can take the port in between.
    ``key_file``: a CURVE server with that cluster key ("" for plain TCP)."""
    import zmq

    from bps.common.auth import Guard, read_key_file

    guard = Guard(zmq.Context.instance(), read_key_file(key_file) if key_file else None)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    guard.serve(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    for _ in range(messages):
        if not sock.poll(RAW_TIMEOUT_S * 1000):
            raise SystemExit(f"raw server: no message from any worker for {RAW_TIMEOUT_S} s")
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    sock.close(linger=RAW_TIMEOUT_S * 1000)
    guard.close()
    # pyzmq drops what is still queued at interpreter exit: the last echoes go out only
    # if the context is terminated first (the cause of the scheduler's lost SHUTDOWNs)
    zmq.Context.instance().term()


def raw_worker(port: int, mbytes: int, steps: int, out: str, key_file: str) -> None:
    """DEALER: per step send every partition (header + payload frames), receive all back."""
    import numpy as np
    import zmq

    from bps.common.auth import connect_as_client, read_key_file

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    connect_as_client(sock, read_key_file(key_file) if key_file else None)
    sock.connect(f"tcp://127.0.0.1:{port}")
    buffers = [np.random.default_rng(i).standard_normal(n, dtype=np.float32)
               for i, n in enumerate(partitions(mbytes))]
    times = []
    for _ in range(steps + WARMUP_STEPS):
        start = time.perf_counter()
        for i, buf in enumerate(buffers):
            sock.send_multipart([i.to_bytes(8, "little"), buf], copy=False)
        for _ in buffers:
            if not sock.poll(RAW_TIMEOUT_S * 1000):
                raise SystemExit(f"raw worker: no echo from the server on port {port} "
                                 f"for {RAW_TIMEOUT_S} s")
            sock.recv_multipart(copy=False)
        times.append(time.perf_counter() - start)
    sock.close()
    Path(out).write_text(json.dumps({"times": times[WARMUP_STEPS:]}))


def run_raw(mbytes: int, steps: int, tmp: Path, key_file: str = "", attempts: int = 2
            ) -> float:
    """Median step time of the echo baseline. A run where an echo never arrives (seen
    rarely before commit ba64ae7, when the echo server did not yet terminate its context
    before exiting, which may have been the cause; not reproduced) fails after
    RAW_TIMEOUT_S and is retried once."""
    for _ in range(attempts - 1):
        try:
            return run_raw_once(mbytes, steps, tmp, key_file)
        except RuntimeError as exc:
            print(f"warning: {exc}; retrying", file=sys.stderr)
    return run_raw_once(mbytes, steps, tmp, key_file)


def run_raw_once(mbytes: int, steps: int, tmp: Path, key_file: str) -> float:
    count = len(partitions(mbytes)) * (steps + WARMUP_STEPS) * 2
    me = [sys.executable, __file__]
    procs = [subprocess.Popen(me + ["--raw-server", str(count), key_file],
                              stdout=subprocess.PIPE, text=True)]
    port = procs[0].stdout.readline().strip()
    if not port:
        raise RuntimeError("raw ZeroMQ baseline: the echo server did not start")
    procs += [subprocess.Popen(me + ["--raw-worker", str(port), str(mbytes), str(steps),
                                     str(tmp / f"raw{w}.json"), key_file]) for w in range(2)]
    try:
        for proc in procs:
            if proc.wait(timeout=4 * RAW_TIMEOUT_S) != 0:
                raise RuntimeError("raw ZeroMQ baseline failed")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    times = [json.loads((tmp / f"raw{w}.json").read_text())["times"] for w in range(2)]
    return statistics.median(max(pair) for pair in zip(*times, strict=True))


# ---------------------------------------------------------------------- bps

def bps_worker(mbytes: int, steps: int, params_json: str, out: str) -> None:
    """Runs under bpslaunch: declare the partitions, time push_pull steps; writes the
    times to ``out`` with ``{node}`` replaced by this worker node's id."""
    import torch

    from bps.common.env import ClusterEnv
    from bps.worker.engine import WorkerEngine

    params = json.loads(params_json)
    if params is not None:
        from bps.compressors import validate_compression_params

        params = validate_compression_params(params)
        params["seed"] = params.get("seed") or 1
    engine = WorkerEngine.connect(ClusterEnv.from_environ())
    sizes = partitions(mbytes)
    for key, numel in enumerate(sizes):
        engine.declare(key, numel, torch.float32, params, name=f"bench[{key}]")
    gen = torch.Generator().manual_seed(engine.node_id)
    tensors = [torch.randn(n, generator=gen) for n in sizes]
    engine.barrier()
    times, wire = [], []
    for step in range(steps + WARMUP_STEPS):
        before = engine.stats
        start = time.perf_counter()
        futures = [engine.push_pull(key, t, step, 0.1, priority=-key)
                   for key, t in enumerate(tensors)]
        for future in futures:
            future.result()
        times.append(time.perf_counter() - start)
        delta = engine.stats - before
        wire.append(delta.bytes_pushed + delta.bytes_pulled)
    engine.barrier()
    from bps.common.striping import io_thread_cpu_seconds

    # the scheduler link's thread first (its context is older), then the data connections'
    striping = {"connections": engine._io.connections, "io_threads": engine._io.io_threads,
                "io_cpu_s": io_thread_cpu_seconds()}
    engine.close()
    Path(out.format(node=engine.node_id)).write_text(json.dumps({"times": times[WARMUP_STEPS:],
                                                                "wire": wire[WARMUP_STEPS:],
                                                                **striping}))


def run_bps(mbytes: int, steps: int, params: dict | None, tmp: Path, tag: str,
            secure: bool = True, **extra_env: str) -> dict:
    cmd = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", "2", "--servers", "1",
           "--", sys.executable, __file__, "--bps-worker", str(mbytes), str(steps),
           json.dumps(params), str(tmp / f"{tag}{{node}}.json")]
    env = {"BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES), **os.environ,
           "BPS_INSECURE": "0" if secure else "1", **extra_env}  # local makes a key if 0
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"bps run {tag} failed:\n{proc.stdout[-4000:]}")
    runs = [json.loads((tmp / f"{tag}{n}.json").read_text()) for n in range(2)]
    step = statistics.median(max(pair) for pair in zip(*(r["times"] for r in runs), strict=True))
    server_threads = re.search(r"server at \S+: (\d+) ZeroMQ I/O thread",
                               proc.stdout + proc.stderr)
    # the server's I/O threads' CPU: each connection's CURVE work runs on one of them
    io_cpu = re.search(r"ZeroMQ I/O threads' CPU seconds: ([\d., ]+)", proc.stdout + proc.stderr)
    return {"step_s": step, "wire_bytes_per_worker": statistics.median(runs[0]["wire"]),
            "connections": runs[0].get("connections"),
            "worker_io_threads": runs[0].get("io_threads"),
            "server_io_threads": int(server_threads.group(1)) if server_threads else None,
            "server_io_cpu_s": [float(v) for v in io_cpu.group(1).split(", ")] if io_cpu
            else None, "worker_io_cpu_s": [r.get("io_cpu_s") for r in runs]}


def children_cpu() -> float:
    """CPU seconds (user + system) of every finished child process and its descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_per_step(run, steps: int) -> float:
    """CPU seconds per step of ``run(steps)``: runs of ``steps`` and ``4 * steps`` steps,
    the difference over the extra steps."""
    start = children_cpu()
    run(steps)
    short = children_cpu() - start
    run(4 * steps)
    long = children_cpu() - start - short
    return (long - short) / (3 * steps)


CPU_CONFIGS = {  # name -> (kind, CURVE?, compression params)
    "raw ZeroMQ (echo, no processing), plain TCP": ("raw", False, None),
    "raw ZeroMQ (echo, no processing), CURVE": ("raw", True, None),
    "bps uncompressed float32, CURVE": ("bps", True, None),
    "bps uncompressed float32, BPS_INSECURE=1": ("bps", False, None),
    "bps onebit + EF, CURVE": ("bps", True, {"compressor": "onebit", "scaling": True,
                                             "ef": "vanilla"}),
    "bps onebit + EF, BPS_INSECURE=1": ("bps", False, {"compressor": "onebit",
                                                       "scaling": True, "ef": "vanilla"}),
    "bps topk 1% + EF, CURVE": ("bps", True, {"compressor": "topk", "k": 0.01,
                                              "ef": "vanilla"}),
    "bps topk 1% + EF, BPS_INSECURE=1": ("bps", False, {"compressor": "topk", "k": 0.01,
                                                        "ef": "vanilla"}),
}


def cpu_table(mbytes: int, steps: int, rounds: int, tmp: Path, key_file: str,
              only: str = "") -> None:
    """The ``--cpu`` table (see the module docstring); ``only``: the configurations whose
    name contains it."""
    runs: dict[str, list[float]] = {name: [] for name in CPU_CONFIGS if only in name}
    load = [os.getloadavg()[0]]
    for index in range(rounds):
        names = list(runs) if index % 2 == 0 else list(runs)[::-1]
        for name in names:
            kind, curve, params = CPU_CONFIGS[name]
            if kind == "raw":
                def run(n: int, curve: bool = curve) -> None:
                    run_raw(mbytes, n, tmp, key_file if curve else "")
            else:
                def run(n: int, curve: bool = curve, params: dict | None = params) -> None:
                    run_bps(mbytes, n, params, tmp, "cpu", secure=curve)
            runs[name].append(cpu_per_step(run, steps))
    load.append(os.getloadavg()[0])
    cpu = {name: statistics.median(v) for name, v in runs.items()}
    print(f"2 workers x 1 server, loopback, {mbytes} MB float32 per worker per step; CPU "
          f"seconds per step of all processes, median of {rounds} alternating rounds; load "
          f"average {load[0]:.1f} -> {load[1]:.1f}\n")
    print("| configuration | CPU s per step | rounds | CPU / 2 cores |")
    print("|---|---:|---|---:|")
    for name, value in cpu.items():
        print(f"| {name} | {value:.3f} | {', '.join(f'{v:.3f}' for v in runs[name])} "
              f"| {value / 2:.3f} s |")
    if len(cpu) == len(CPU_CONFIGS):
        raw = cpu["raw ZeroMQ (echo, no processing), plain TCP"]
        print(f"\nCPU of raw ZeroMQ plain TCP / bps uncompressed with CURVE: "
              f"{raw / cpu['bps uncompressed float32, CURVE']:.2f}")
        for label in ("onebit + EF", "topk 1% + EF"):
            extra = cpu[f"bps {label}, CURVE"] / cpu[f"bps {label}, BPS_INSECURE=1"] - 1
            print(f"{label}: CURVE costs {extra:+.1%} CPU per step")
    (tmp / "ps_cpu.json").write_text(json.dumps({"runs": runs, "median": cpu,
                                                 "load": load}, indent=2))


def throughput_table(mbytes: int, steps: int, rounds_count: int, tmp: Path,
                     key_file: str) -> None:
    """The default table (see the module docstring), to stdout and ps_throughput.json."""
    # alternate baseline and bps runs and keep each one's best round: robust to other
    # load on the machine, and both sides see the same conditions
    rounds: dict[str, list] = {"raw": [], "raw_curve": [], "plain": [], "plain_insecure": []}
    for _ in range(rounds_count):
        rounds["raw"].append(run_raw(mbytes, steps, tmp))
        rounds["raw_curve"].append(run_raw(mbytes, steps, tmp, key_file))
        rounds["plain"].append(run_bps(mbytes, steps, None, tmp, "plain"))
        rounds["plain_insecure"].append(run_bps(mbytes, steps, None, tmp, "plainx",
                                                secure=False))
    raw, raw_curve = min(rounds["raw"]), min(rounds["raw_curve"])
    plain = min(rounds["plain"], key=lambda r: r["step_s"])
    plain_insecure = min(rounds["plain_insecure"], key=lambda r: r["step_s"])
    compressed = {}
    for name, params in (("onebit", {"compressor": "onebit", "scaling": True, "ef": "vanilla"}),
                         ("topk", {"compressor": "topk", "k": 0.01, "ef": "vanilla"})):
        runs = {True: [], False: []}
        for index in range(max(1, rounds_count - 1)):  # alternating order, best of each
            for secure in ((True, False) if index % 2 == 0 else (False, True)):
                runs[secure].append(run_bps(mbytes, steps, params, tmp,
                                            f"{name}{int(secure)}", secure=secure))
        compressed[name] = {secure: min(r, key=lambda x: x["step_s"])
                            for secure, r in runs.items()}
    moved = 2 * 2 * mbytes  # two workers, push + pull
    rows = [("raw ZeroMQ (echo, no processing), plain TCP", raw, 2 * mbytes * 1e6),
            ("raw ZeroMQ (echo, no processing), CURVE", raw_curve, 2 * mbytes * 1e6),
            ("bps uncompressed float32, CURVE", plain["step_s"],
             plain["wire_bytes_per_worker"]),
            ("bps uncompressed float32, BPS_INSECURE=1", plain_insecure["step_s"],
             plain_insecure["wire_bytes_per_worker"])]
    for name, label in (("onebit", "bps onebit + EF"), ("topk", "bps topk 1% + EF")):
        for secure, how in ((True, "CURVE"), (False, "BPS_INSECURE=1")):
            run = compressed[name][secure]
            rows.append((f"{label}, {how}", run["step_s"], run["wire_bytes_per_worker"]))
    print(f"2 workers x 1 server, loopback, {mbytes} MB float32 per worker per step, "
          f"{len(partitions(mbytes))} partitions, median of {steps} steps, best of "
          f"{rounds_count} alternating rounds (rounds: " + "; ".join(
              f"{name} " + ", ".join(f"{t if isinstance(t, float) else t['step_s']:.3f}"
                                     for t in times) for name, times in rounds.items())
          + " s)\n")
    print("| configuration | step time (s) | push+pull throughput (MB/s) | wire bytes per "
          "worker per step |")
    print("|---|---|---|---|")
    for name, step, wire in rows:
        print(f"| {name} | {step:.3f} | {moved / step:.0f} | {wire / 1e6:.2f} MB |")
    ratio = raw / plain["step_s"]
    ratio_insecure = raw / plain_insecure["step_s"]
    print(f"\nbps with CURVE / raw ZeroMQ on plain TCP (uncompressed): {ratio:.2f} "
          f"(target >= 0.5); without CURVE: {ratio_insecure:.2f} (target >= 0.7)")
    for name in compressed:
        cost = compressed[name][True]["step_s"] / compressed[name][False]["step_s"] - 1
        print(f"{name}: CURVE costs {cost:+.1%} of the step time (target within 5%)")
    result = {"mbytes": mbytes, "steps": steps, "raw_step_s": raw,
              "raw_curve_step_s": raw_curve, "rounds": rounds, "plain": plain,
              "plain_insecure": plain_insecure,
              "compressed": {n: {"curve": c[True], "insecure": c[False]}
                             for n, c in compressed.items()},
              "ratio": ratio, "ratio_insecure": ratio_insecure}
    (tmp / "ps_throughput.json").write_text(json.dumps(result, indent=2))


def striping_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores`` (and ``cores`` itself)."""
    counts = [1]
    while counts[-1] * 2 <= cores:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == cores else counts + [cores]


def striping_table(mbytes: int, steps: int, rounds_count: int, tmp: Path,
                   key_file: str) -> None:
    """The ``--striping`` table (see the module docstring), to ps_striping.json."""
    from bps.common.striping import host_cores

    cores = host_cores()
    counts = striping_counts(cores)
    configs = [("raw", True, 1), ("raw", False, 1)]
    configs += [("bps", secure, n) for n in counts for secure in (True, False)]
    runs: dict[str, list] = {}
    load = [os.getloadavg()[0]]
    began = time.perf_counter()
    for index in range(rounds_count):
        for kind, secure, n in (configs if index % 2 == 0 else configs[::-1]):
            name = f"{kind}/{'curve' if secure else 'plain'}/{n}"
            if kind == "raw":
                result = {"step_s": run_raw(mbytes, steps, tmp, key_file if secure else "")}
            else:
                result = run_bps(mbytes, steps, None, tmp, f"stripe{n}{int(secure)}", secure,
                                 BPS_CONNECTIONS_PER_SERVER=str(n))
            runs.setdefault(name, []).append(result)
    load.append(os.getloadavg()[0])
    best = {name: min(r, key=lambda x: x["step_s"]) for name, r in runs.items()}
    moved = 2 * 2 * mbytes  # two workers, push + pull
    raw_plain = best["raw/plain/1"]["step_s"]
    print(f"2 workers x 1 server, loopback, {cores} cores, {mbytes} MB float32 per worker "
          f"per step, median of {steps} steps, best of {rounds_count} alternating rounds, "
          f"{time.perf_counter() - began:.0f} s, load average {load[0]:.1f} -> {load[1]:.1f}\n")
    print("| configuration | connections per pair | I/O threads (worker, server) | step (s) "
          "| push+pull MB/s | / N=1 | / raw plain TCP | server I/O threads' CPU (s) "
          "| worker 0's (s) |")
    print("|---|---:|---|---:|---:|---:|---:|---|---|")
    for secure, how in ((True, "CURVE"), (False, "plain TCP")):
        raw = best[f"raw/{'curve' if secure else 'plain'}/1"]["step_s"]
        print(f"| raw ZeroMQ echo, {how} | 1 | 1, 1 | {raw:.3f} | {moved / raw:.0f} | "
              f"| {raw_plain / raw:.2f} | | |")
        one = best[f"bps/{'curve' if secure else 'plain'}/1"]["step_s"]
        for n in counts:
            r = best[f"bps/{'curve' if secure else 'plain'}/{n}"]
            spread = ", ".join(f"{v:.1f}" for v in r.get("server_io_cpu_s") or [])
            worker = ", ".join(f"{v:.1f}" for v in (r.get("worker_io_cpu_s") or [None])[0] or [])
            print(f"| bps uncompressed, {how} | {n} | {r['worker_io_threads']}, "
                  f"{r['server_io_threads']} | {r['step_s']:.3f} | {moved / r['step_s']:.0f} "
                  f"| {one / r['step_s']:.2f} | {raw_plain / r['step_s']:.2f} | {spread} "
                  f"| {worker} |")
    (tmp / "ps_striping.json").write_text(json.dumps(
        {"mbytes": mbytes, "steps": steps, "rounds": rounds_count, "cores": cores,
         "load": load, "runs": runs, "best": best}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbytes", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true",
                        help="CPU seconds per step of each configuration (see the docstring)")
    parser.add_argument("--striping", action="store_true",
                        help="connections per worker-server pair, CURVE and plain (see the "
                             "docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="--striping in under 3 minutes: 1 round, 3 steps, 50 MB")
    parser.add_argument("--only", default="",
                        help="--cpu: only the configurations whose name contains this")
    parser.add_argument("--raw-server", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--raw-worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--bps-worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        raw_server(int(args.raw_server[0]), args.raw_server[1])
        return
    if args.raw_worker:
        port, mbytes, steps, out, key_file = args.raw_worker
        raw_worker(int(port), int(mbytes), int(steps), out, key_file)
        return
    if args.bps_worker:
        mbytes, steps, params, out = args.bps_worker
        out = out.format(node=os.environ["DMLC_WORKER_ID"])
        bps_worker(int(mbytes), int(steps), params, out)
        return

    import shutil
    import tempfile

    from bps.common.auth import write_key_file

    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    key_dir = tempfile.mkdtemp(prefix="bps-bench-key-")
    try:
        key_file = os.path.join(key_dir, "cluster.key")
        write_key_file(key_file)
        if args.striping:
            if args.quick:
                args.rounds, args.steps, args.mbytes = 1, 3, 50
            striping_table(args.mbytes, args.steps, args.rounds, out, key_file)
        elif args.cpu:
            cpu_table(args.mbytes, args.steps, args.rounds, out, key_file, args.only)
        else:
            throughput_table(args.mbytes, args.steps, args.rounds, out, key_file)
    finally:
        shutil.rmtree(key_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
