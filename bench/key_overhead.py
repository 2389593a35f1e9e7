"""What bps costs per parameter and per key: a worker's CPU per step, thread by thread.

Usage::

    python bench/key_overhead.py                          # host chains and device path
    python bench/key_overhead.py --layers 74 --width 256 --steps 100 --rounds 3
    python bench/key_overhead.py --node-agent --only host # with and without the node agent
    python bench/key_overhead.py --only "host, node agent" # the node agent only
    python bench/key_overhead.py --convoy                 # torch calls beside a busy thread
    python bench/key_overhead.py --neighbour --steps 200  # the model beside a busy core

A model of ``--layers`` ``Linear(width, width)`` layers (a weight over
``min_compress_bytes``, compressed, and a small bias each) on a batch of 4 has almost no
compute: what a step costs beyond the model alone is bps's own work for each parameter
(the autograd hook) and each key (reduce thread, codec threads, I/O thread, the
broadcast thread). That per-key work is what a GPU job pays in Python, under the GIL,
for every partition (docs/benchmarks.md, one GPU host).

Per configuration and round, ``bpslaunch local --workers 1 --servers 1`` (CURVE on)
runs the model alone, then through a ``DistributedTrainer`` with onebit + error
feedback (the biases' buckets in ``--comm-dtype``, fp16 by default as in
compression_params): the host chains, and the device path forced onto CPU tensors
(``BPS_DEVICE_KERNELS=1``). The job runs with ``OMP_NUM_THREADS=1``: on a host of few
cores, torch's OpenMP workers otherwise spin for cores the job's threads need. Per
configuration: the median step and its forward and backward pass (where the hooks
run), the worker's CPU per step in all and by thread (Python threads from their
own CPU clocks, others from ``/proc/self/task``), the pushes per step, CPU per
push beyond the model alone, and the time the training process spends in bps's
autograd hook per parameter (50th and 99th percentile); medians over ``--rounds``.
``--node-agent`` also runs each configuration with ``BPS_NODE_AGENT=1`` in the same
rounds: the engine (and, with the host chains, the gradient pipeline, on ``.grad`` in
shared memory) in a node agent process, whose CPU counts in the column ``node agent``
and in the totals. The server process's CPU per step (read from ``/proc``, 10 ms ticks:
use enough ``--steps``) is in the column ``server`` and per push in ``server us / push``,
apart from the worker's totals. JSON: ``--json`` (default
bench/results/key_overhead-TIME.json).

``--neighbour`` times the model's forward and backward pass alone on one core, beside a
process spinning in registers on the other, and beside one streaming memory there: the
node agent and the server stream their buffers on the cores the training process shares
with them, and that alone slows its passes (docs/benchmarks.md).

``--convoy`` times a hook's kinds of calls, and a codec thread's work for one key of a
host chain, alone and beside one thread that runs Python without pause: torch releases
the GIL in each op it dispatches (numba in each ``nogil`` kernel), and taking it back
waits for the other thread to give it up (``sys.getswitchinterval()``, 5 ms by
default), so every such call can cost milliseconds while bps's threads run Python.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_step import source_commit  # bench/ is on the path of a script run from it

from bps.common.striping import proc_threads
from bps.launch.local import sibling_pids

PARAMS = {"compressor": "onebit", "ef": "vanilla"}
CONFIGS = {"alone": None, "host": {}, "device path": {"BPS_DEVICE_KERNELS": "1"},
           # the engine in a node agent process (--node-agent)
           "host, node agent": {"BPS_NODE_AGENT": "1"},
           "device path, node agent": {"BPS_DEVICE_KERNELS": "1", "BPS_NODE_AGENT": "1"}}


def chosen_configs(text: str) -> list[str]:
    """The configurations ``--only`` names, comma-separated; a name with a comma of its
    own ("host, node agent") is taken whole.

        >>> chosen_configs("alone,host, node agent")
        ['alone', 'host, node agent']
    """
    pieces, names = [piece.strip() for piece in text.split(",")], []
    while pieces:
        whole = ", ".join(pieces[:2])
        taken = 2 if len(pieces) > 1 and whole in CONFIGS else 1
        names.append(whole if taken == 2 else pieces[0])
        del pieces[:taken]
    return names


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def process_cpu_s(pid: int) -> float:
    """CPU seconds so far of process ``pid`` (user + system, every thread; 10 ms ticks)."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(agent: int | None = None) -> dict[str, float]:
    """CPU seconds so far of each of this process's threads, by name (numbered
    threads of one pool summed). Python threads are read from their own CPU clocks,
    to the nanosecond: a few short steps are well under the 10 ms tick of
    ``/proc``, which counts only the threads without a Python name (by OS name).
    ``agent``: the pid of the node agent (``BPS_NODE_AGENT=1``), counted as a whole."""
    import threading

    out: collections.Counter = collections.Counter()
    python_ids = set()
    for thread in threading.enumerate():
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):  # ended meanwhile, or not started
            continue
        python_ids.add(thread.native_id)
        out[thread.name.rstrip("0123456789_/")] += seconds
    for tid, name, seconds in proc_threads():
        if tid not in python_ids:
            out[name.rstrip("0123456789_/")] += seconds
    if agent is not None:
        out["node agent"] = process_cpu_s(agent)
    return dict(out)


def child(args: argparse.Namespace) -> None:
    """One worker's measurement (runs under bpslaunch)."""
    import torch

    import bps

    bps.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # bps's hook per parameter, timed between a hook registered before the trainer's
    # and one after it (a tensor's hooks run in the order they were registered)
    began: dict[int, float] = {}
    hook_s: list[float] = []
    if not args.alone:
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(
                lambda p: began.__setitem__(id(p), time.perf_counter()))
    trainer = None if args.alone else bps.DistributedTrainer(
        model, optimizer, {**PARAMS, "comm_dtype": args.comm_dtype})
    if trainer is not None:
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(
                lambda p: hook_s.append(time.perf_counter() - began[id(p)]))
    agent = getattr(trainer.core.runtime.engine, "pid", None) if trainer else None
    x = torch.randn(4, args.width)

    backward_s: list[float] = []

    def step() -> None:
        (trainer or optimizer).zero_grad()
        start = time.perf_counter()
        model(x).square().mean().backward()
        backward_s.append(time.perf_counter() - start)
        (trainer or optimizer).step()

    for _ in range(args.warmup):
        step()
    backward_s.clear()
    hook_s.clear()
    pushes_before = trainer.core.runtime.engine.stats.pushes if trainer else 0
    servers = sibling_pids("server") if trainer else []
    server_before = sum(map(process_cpu_s, servers))
    before, walls = thread_cpu_s(agent), []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    after = thread_cpu_s(agent)
    server_s = sum(map(process_cpu_s, servers)) - server_before
    pushes = (trainer.core.runtime.engine.stats.pushes - pushes_before) if trainer else 0
    if trainer is not None:
        trainer.close()
    threads = {name: (after[name] - before.get(name, 0.0)) / args.steps for name in after}
    Path(args.out).write_text(json.dumps({
        "step_s": statistics.median(walls), "backward_s": statistics.median(backward_s),
        "pushes": pushes / args.steps,
        "hook_us": [percentile(hook_s, 50) * 1e6, percentile(hook_s, 99) * 1e6]
        if hook_s else None,
        "server_s": server_s / args.steps if servers else None,
        "threads_s": {k: v for k, v in threads.items() if v > 0}}))
    bps.shutdown()


def convoy(calls: int = 50) -> str:
    """Microseconds per call of a hook's kinds of calls, alone and beside a thread that
    runs Python without pause (the table ``--convoy`` prints)."""
    import threading

    import torch

    from bps.compressors import build

    chain = build({"compressor": "onebit", "scaling": True, "ef": "vanilla",
                   "momentum": "nesterov", "mu": 0.9}, 65536)
    grad, aggregate = torch.randn(65536), torch.empty(65536)

    def chain_pair() -> None:  # what a codec thread runs per key, one push and its pull
        chain.set_lr(0.1)
        chain.decompress(chain.compress(grad), aggregate)

    chain_pair()  # numba's kernels load once
    import zmq

    idle = zmq.Context.instance().socket(zmq.DEALER)  # nothing ever waits on it
    idle.bind("inproc://convoy-idle")

    def failed_receive() -> None:
        try:
            idle.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass

    wake_r, wake_w = os.pipe()  # as the engine wakes its I/O thread
    os.set_blocking(wake_r, False)

    def empty_read() -> None:
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass

    tensor = torch.zeros(65536)
    param = torch.nn.Parameter(torch.zeros(65536))
    param.grad = torch.zeros(65536)
    cases = {"Tensor.view": lambda: tensor.view(-1), "Tensor.detach": tensor.detach,
             "Tensor.div_ (10 elements)": lambda: tensor[:10].div_(1.0),
             "Tensor.numpy": tensor.numpy, "Parameter.grad": lambda: param.grad,
             "Tensor.numel": tensor.numel, "a Python call": lambda: sum(range(10)),
             "onebit + EF + Nesterov: compress, decompress (65,536)": chain_pair,
             "zmq: a receive with nothing waiting (EAGAIN)": failed_receive,
             "zmq: ZMQ_EVENTS": lambda: idle.getsockopt(zmq.EVENTS),
             "pipe: a write of one byte": lambda: os.write(wake_w, b"x"),
             "pipe: a read with nothing waiting (EAGAIN)": empty_read}

    def per_call(fn) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    alone = {name: per_call(fn) for name, fn in cases.items()}
    stop = threading.Event()

    def busy() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        beside = {name: per_call(fn) for name, fn in cases.items()}
    finally:
        stop.set()
        thread.join()
        idle.close(linger=0)
        os.close(wake_r)
        os.close(wake_w)
    rows = [f"switch interval {sys.getswitchinterval() * 1e3:g} ms; {calls} calls each\n",
            "| call | alone us | beside a busy Python thread us |", "|---|---:|---:|"]
    rows += [f"| {name} | {alone[name]:.2f} | {beside[name]:.1f} |" for name in cases]
    return "\n".join(rows)


NEIGHBOURS = {
    "alone": None,
    "beside a process spinning in registers": "print(flush=True)\nwhile True:\n    pass",
    # two 32 MiB arrays: beyond any core's own cache, as the agent's and server's buffers
    "beside a process streaming memory": (
        "import numpy as np\na = np.ones(8 << 20, dtype=np.float32)\nb = np.empty_like(a)\n"
        "print(flush=True)\nwhile True:\n    np.add(a, 1.0, out=b)"),
}


def neighbour(args: argparse.Namespace) -> str:
    """The model's forward + backward alone (one thread, on this process's first core),
    beside each of :data:`NEIGHBOURS` on another core: what the node agent and the
    server, whose kernels stream their buffers, cost the training process by sharing
    the memory system alone (the table ``--neighbour`` prints)."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--neighbour needs two cores")
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.layers)])
    x = torch.randn(4, args.width)

    def forward_backward_s() -> float:
        model.zero_grad()
        start = time.perf_counter()
        model(x).square().mean().backward()
        return time.perf_counter() - start

    rows = [f"{args.layers} x Linear({args.width}, {args.width}), batch 4, one thread; "
            f"median of {args.steps} passes\n",
            "| the other core | forward + backward ms | x alone |", "|---|---:|---:|"]
    alone = None
    for name, code in NEIGHBOURS.items():
        other = None if code is None else subprocess.Popen(
            ["taskset", "-c", str(cores[1]), sys.executable, "-c", code],
            stdout=subprocess.PIPE)
        try:
            if other is not None:
                other.stdout.readline()  # its loop begins
            for _ in range(args.warmup):
                forward_backward_s()
            median = statistics.median(forward_backward_s() for _ in range(args.steps))
        finally:
            if other is not None:
                other.kill()
                other.wait()
        alone = alone or median
        rows.append(f"| {name} | {median * 1e3:.2f} | {median / alone:.2f} |")
    return "\n".join(rows)


def run_config(args: argparse.Namespace, env: dict | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", "1",
               "--servers", "1", "--", sys.executable, os.path.abspath(__file__), "--child",
               "--out", out, "--layers", str(args.layers), "--width", str(args.width),
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--comm-dtype", args.comm_dtype]
        cmd += ["--alone"] if env is None else []
        full_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
        full_env.pop("BPS_INSECURE", None)
        done = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"the job failed (exit {done.returncode}):\n"
                             f"{(done.stdout + done.stderr)[-3000:]}")
        return json.loads(Path(out).read_text())


def table(results: dict) -> str:
    names = sorted({t for rounds in results.values() for r in rounds for t in r["threads_s"]},
                   key=lambda t: (t != "MainThread", t))
    alone = statistics.median(sum(r["threads_s"].values()) for r in results["alone"])
    rows = ["| configuration | step ms | forward + backward ms | CPU ms | pushes | "
            "CPU us / push beyond alone | hook p50 us | hook p99 us | "
            + " | ".join(names) + " | server ms | server us / push |",
            "|---|" + "---:|" * (9 + len(names))]
    for config, rounds in results.items():
        def med(get, rounds=rounds):
            return statistics.median(get(r) for r in rounds)
        cpu = med(lambda r: sum(r["threads_s"].values()))
        pushes = med(lambda r: r["pushes"])
        per_push = f"{(cpu - alone) / pushes * 1e6:.0f}" if pushes else ""
        cells = [f"{med(lambda r, t=t: r['threads_s'].get(t, 0.0)) * 1e3:.1f}" for t in names]
        hooks = [f"{med(lambda r, i=i: r['hook_us'][i]):.0f}" if rounds[0].get("hook_us")
                 else "" for i in (0, 1)]
        server = ["", ""]
        if rounds[0].get("server_s") is not None:
            server_s = med(lambda r: r["server_s"])
            server = [f"{server_s * 1e3:.1f}", f"{server_s / pushes * 1e6:.0f}" if pushes
                      else ""]
        rows.append(f"| {config} | {med(lambda r: r['step_s']) * 1e3:.1f} "
                    f"| {med(lambda r: r['backward_s']) * 1e3:.1f} | {cpu * 1e3:.1f} "
                    f"| {pushes:.0f} | {per_push} | {hooks[0]} | {hooks[1]} | "
                    + " | ".join(cells) + f" | {server[0]} | {server[1]} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=74, help="Linear layers (default 74)")
    p.add_argument("--width", type=int, default=256, help="their width (default 256)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per job (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--comm-dtype", default="fp16", choices=("fp16", "bf16", "fp32"),
                   help="compression_params' comm_dtype: the biases' buckets on the wire "
                        "(default fp16)")
    p.add_argument("--rounds", type=int, default=3, help="jobs per configuration, "
                   "taking turns (default 3)")
    p.add_argument("--only", default="alone,host,device path",
                   help="configurations, comma-separated (of "
                        f"{'; '.join(CONFIGS)})")
    p.add_argument("--node-agent", action="store_true",
                   help="also run each configuration with BPS_NODE_AGENT=1 (the engine in "
                        "a node agent process), in the same rounds")
    p.add_argument("--timeout", type=int, default=300, help="seconds per job")
    p.add_argument("--json", default=None)
    p.add_argument("--convoy", action="store_true",
                   help="only time torch calls beside a busy Python thread")
    p.add_argument("--neighbour", action="store_true",
                   help="only time the model alone beside a busy process on another core")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.convoy:
        print(convoy())
        return
    if args.neighbour:
        print(neighbour(args))
        return
    configs = chosen_configs(args.only)
    if args.node_agent:
        configs += [f"{c}, node agent" for c in configs
                    if f"{c}, node agent" in CONFIGS and f"{c}, node agent" not in configs]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--only: unknown configuration {unknown[0]!r}")
    if "alone" not in configs:
        configs.insert(0, "alone")  # the baseline of the per-push column
    started = time.monotonic()
    results: dict[str, list] = {c: [] for c in configs}
    for round_ in range(args.rounds):
        for config in configs:
            print(f"[{time.monotonic() - started:6.1f} s] round {round_ + 1}: {config}",
                  file=sys.stderr, flush=True)
            results[config].append(run_config(args, CONFIGS[config]))
    commit = source_commit() or "?"
    print(f"\n{os.cpu_count()} cores, commit {commit}, "
          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; {args.layers} x "
          f"Linear({args.width}, {args.width}), onebit + EF, 1 worker, 1 server, CURVE; "
          f"medians of {args.rounds} rounds of {args.steps} steps\n")
    print(table(results))
    path = Path(args.json or Path(__file__).parent / "results" /
                f"key_overhead-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "commit": commit, "results": results},
                               indent=1))
    print(f"\n{time.monotonic() - started:.0f} s in all; wrote {path}")


if __name__ == "__main__":
    main()
