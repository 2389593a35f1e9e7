"""Server throughput: how fast one server decodes, sums and re-encodes 2 nodes' pushes.

Usage::

    .venv/bin/python bench/server_throughput.py            # 1, 2, 4, ... threads up to the cores
    .venv/bin/python bench/server_throughput.py --threads 1 8 --keys 32 --steps 5
    .venv/bin/python bench/server_throughput.py --keys 80 --cases onebit   # GPT-2 small
    .venv/bin/python bench/server_throughput.py --cases "fp32 raw" --frame-bytes 131072

``--keys 80``: one of 2 servers' share of GPT-2 small (162.6M float32 elements in
partitions of 1,024,000).

Drives a real :class:`bps.server.server.ParameterServer`'s engine threads (``KeyEngine``:
their inboxes, the real decode, node-order sum, error feedback and re-encode, replies on
the inproc socket) with the pushes of 2 worker nodes, without the network or the I/O
thread: the compute a server does per step, as ``BPS_SERVER_THREADS`` engine threads
share it. Each of ``--keys`` keys is one partition of BYTEPS_PARTITION_BYTES (default
4,096,000: 1,024,000 float32 elements, 2,048,000 float16); each node's pushes are its
worker chain's payloads of random gradients. Per compressor (with error feedback on
both ends, as a job runs it) and thread count: the median wall time of ``--steps``
steps after one warm-up step and the best one, the partition bytes aggregated per
second (``GB/s``: keys x partition bytes / median step time), the speed-up of the
median over one thread's, the process's CPU time in the step (all threads: on a
busy host it moves less than the wall time) and the ``server_s`` the replies carried
(engine-thread seconds, summed over keys). Results: stdout (markdown) and ``--json``
(default bench/results/server_throughput.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import zmq

from bps.common.env import ClusterEnv
from bps.common.protocol import Op, decode, dtype_name, encode, payload_frames, server_seconds
from bps.common.striping import host_cores
from bps.compressors import build
from bps.server.server import KeyEngine, LeastLoaded, ParameterServer

WORKERS = 2
REPLY_TIMEOUT_MS = 120_000  # a step that takes longer fails, naming the keys not answered
CASES = {  # name -> (compression_params or None for raw keys, dtype)
    "onebit": ({"compressor": "onebit", "scaling": True, "ef": "vanilla"}, torch.float32),
    "topk 1%": ({"compressor": "topk", "k": 0.01, "ef": "vanilla"}, torch.float32),
    "bytegrad": ({"compressor": "bytegrad", "ef": "vanilla"}, torch.float32),
    "randomk 1%": ({"compressor": "randomk", "k": 0.01, "ef": "vanilla", "seed": 7},
                   torch.float32),
    "fp16 raw": (None, torch.float16),
    "fp32 raw": (None, torch.float32),
}


class Rig:
    """A server with ``threads`` engine threads and ``keys`` registered keys of ``numel``
    elements; :meth:`step` hands it every push of one step and waits for every reply."""

    def __init__(self, threads: int, keys: int, numel: int, dtype: torch.dtype,
                 params: dict | None, partition_bytes: int) -> None:
        env = ClusterEnv.from_environ({
            "DMLC_ROLE": "server", "DMLC_NUM_WORKER": str(WORKERS), "DMLC_NUM_SERVER": "1",
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
            "BYTEPS_PARTITION_BYTES": str(partition_bytes)})
        self.ctx = zmq.Context()
        self.server = ParameterServer(env, self.ctx)
        self.server.num_workers = WORKERS
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.bind(self.server.replies_address)
        self.engines = [KeyEngine(self.server, i) for i in range(threads)]
        for engine in self.engines:
            engine.start()
        self.keys, self.numel, self.dtype = list(range(keys)), numel, dtype
        pick = LeastLoaded(self.engines)  # as the server's I/O thread deals keys
        self.owner = {key: pick({"numel": numel}) for key in self.keys}
        self.rid = 0
        self.aggregates: dict[int, list[zmq.Frame]] = {}  # the last step's, per key
        for key in self.keys:
            self._put(key, Op.REGISTER, None, numel=numel, dtype=dtype_name(dtype),
                      name=f"p{key}", params=params, node=0)
        self._collect(Op.OK, 1)

    def _put(self, key: int, op: Op, payload: list | None, **fields: object) -> None:
        self.rid += 1
        header = decode(encode(op, rid=self.rid, key=key, **fields))
        header["peer"] = "bench"
        self.owner[key].inbox.put((b"bench", header, payload))

    def _collect(self, op: Op, each: int) -> list[tuple[dict, list[zmq.Frame]]]:
        """``each`` replies of ``op`` per key (ACKs are skipped) with their payload
        frames; an ERROR raises, and so does a wait of REPLY_TIMEOUT_MS, naming the keys."""
        got: list[tuple[dict, list[zmq.Frame]]] = []
        waiting = dict.fromkeys(self.keys, each)
        while waiting:
            if not self.replies.poll(REPLY_TIMEOUT_MS):
                raise TimeoutError(f"no reply for {REPLY_TIMEOUT_MS / 1000:.0f} s: keys "
                                   f"{sorted(waiting)} still wait for {op.name}")
            frames = self.replies.recv_multipart(copy=False)
            header = decode(frames[1].bytes)
            if header["op"] == Op.ERROR:
                raise RuntimeError(header["msg"])
            if header["op"] == op:
                got.append((header, frames[2:]))
                key = header["key"] if "key" in header else next(iter(waiting))  # OK: none
                waiting[key] -= 1
                if not waiting[key]:
                    del waiting[key]
        return got

    def step(self, step: int, payloads: list[list[bytes]],
             frame_bytes: int = 0) -> tuple[float, float, float]:
        """Push every node's payload of every key, each in frames of ``frame_bytes`` as a
        worker sends it (0: one frame); (wall seconds until every DATA reply arrived,
        this process's CPU seconds in that time, the replies' server_s summed over
        keys)."""
        # fresh frames (not timed): a raw key's sum is taken in its first push's frame
        frames = [[[zmq.Frame(piece, copy=True)
                    for piece in payload_frames(memoryview(body), frame_bytes)]
                   for body in node] for node in payloads]
        start, cpu = time.perf_counter(), time.process_time()
        for node, bodies in enumerate(frames):
            for key, pieces in zip(self.keys, bodies, strict=True):
                self._put(key, Op.PUSH, pieces, step=step, node=node,
                          dtype=dtype_name(self.dtype), numel=self.numel,
                          nbytes=sum(len(piece) for piece in pieces), lr=0.1)
        replies = self._collect(Op.DATA, WORKERS)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        self.aggregates = {header["key"]: frames for header, frames in replies}
        return wall, cpu, sum(server_seconds(header) for header, _ in replies) / WORKERS

    def close(self) -> None:
        for engine in self.engines:
            engine.inbox.put(None)
        for engine in self.engines:
            engine.thread.join(timeout=30)
        self.replies.close(linger=0)
        self.ctx.term()


def worker_payloads(params: dict | None, dtype: torch.dtype, keys: int, numel: int
                    ) -> list[list[bytes]]:
    """Each node's push of each key: its worker chain's payload of a random gradient."""
    gen = torch.Generator().manual_seed(1)
    payloads = []
    for _ in range(WORKERS):
        node = []
        for _ in range(keys):
            grad = (torch.randn(numel, generator=gen) * 1e-2).to(dtype)
            if params is None:
                node.append(grad.numpy().tobytes())
            else:
                chain = build(params, numel, dtype, role="worker")
                chain.set_lr(0.1)
                node.append(chain.compress(grad).numpy().tobytes())
        payloads.append(node)
    return payloads


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... below ``cores``, then ``cores``."""
    counts = [1 << i for i in range(cores.bit_length()) if 1 << i < cores]
    return counts + [cores]


def host_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    return (f"{model}, {host_cores()} cores usable, torch {torch.__version__}, commit "
            f"{commit or '?'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="engine thread counts (default: 1, 2, 4, ... up to the cores)")
    parser.add_argument("--keys", type=int, default=None,
                        help="partitions per step (default: 2 x the most threads, >= 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--partition-bytes", type=int, default=4096000)
    parser.add_argument("--frame-bytes", type=int, default=0,
                        help="pushes in frames of this size, as workers send them with "
                             "BPS_FRAME_BYTES (131072 with CURVE); default 0: one frame")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--json", type=Path,
                        default=Path(__file__).parent / "results" / "server_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the server runs: the parallelism is the engines'
    counts = args.threads or thread_counts(host_cores())
    keys = args.keys or max(8, 2 * max(counts))
    print(f"host: {host_line()}")
    frames = f"frames of {args.frame_bytes} bytes" if args.frame_bytes else "one frame each"
    print(f"{keys} keys of {args.partition_bytes} bytes, {WORKERS} worker nodes, pushes in "
          f"{frames}, median of {args.steps} steps\n")
    print("| case | threads | ms/step | best ms | GB/s | CPU ms/step | server_s ms/step | "
          "speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    began = time.perf_counter()
    for name in args.cases:
        params, dtype = CASES[name]
        numel = args.partition_bytes // dtype.itemsize
        payloads = worker_payloads(params, dtype, keys, numel)
        first = None
        for threads in counts:
            rig = Rig(threads, keys, numel, dtype, params, args.partition_bytes)
            try:
                runs = [rig.step(step, payloads, args.frame_bytes)
                        for step in range(args.steps + 1)][1:]
            finally:
                rig.close()
            wall, cpu, busy = (statistics.median(run[i] for run in runs) for i in range(3))
            best = min(run[0] for run in runs)
            first = first or wall
            rate = keys * args.partition_bytes / wall / 1e9
            print(f"| {name} | {threads} | {wall * 1e3:.1f} | {best * 1e3:.1f} | {rate:.2f} | "
                  f"{cpu * 1e3:.0f} | {busy * 1e3:.0f} | {first / wall:.2f}x |", flush=True)
            results.append({"case": name, "threads": threads, "keys": keys,
                            "partition_bytes": args.partition_bytes,
                            "frame_bytes": args.frame_bytes, "step_s": wall,
                            "best_step_s": best, "cpu_s": cpu, "gb_per_s": rate,
                            "server_s": busy})
    print(f"\n{time.perf_counter() - began:.0f} s in all")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"host": host_line(), "results": results}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
