"""CPU time of the compression chains per training step, summed over a whole cluster.

    .venv/bin/python bench/chain_cost.py              # about a minute
    .venv/bin/python bench/chain_cost.py --threads 2 --partition-bytes 4096000

The slow-network job (bench/slow_network.py: MNIST MLP 784-1100-1100-10, 4 worker
nodes) runs 4 workers and 4 servers on the 2 cores of one machine, so every
millisecond of chain CPU in any process shows up in the step time. For each compressor,
on the job's compressed partitions and random gradients, one process runs what the
cluster runs in one step: 4 worker chains compress (Nesterov + error feedback +
compressor), the server chain sums the 4 pushes and compresses the sum (error feedback
+ compressor), 4 workers decompress the result. Two ways of doing the same work are
timed next to each other, each against the other in alternating steps:

* worker compress, new: Nesterov writes g' over the error buffer in its own pass
  (``ErrorFeedback.compress_corrected``); old: Nesterov into a lookahead buffer, then
  error feedback's own pass (the chain before commit f3bd63c).
* server sum, new: the first push decoded into a reused buffer, the others added with
  ``decompress_add``; old: each push decoded into a fresh or scratch tensor, then added
  (the server before commit f3bd63c).
* dithering's error feedback (worker and server compress), new: ``e = g' - D(c)`` in
  the quantiser's pass (``Dithering.compress_residual``, commit 33a09ab); old: the payload
  decoded and subtracted.

Prints the median milliseconds per step of each part (kernels on ``--threads`` threads;
1 is what the busy cluster effectively gets).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import bps.compressors.threads as threads
from bps.compressors import build
from bps.compressors.dithering import Dithering
from bps.compressors.error_feedback import ErrorFeedback, add_scaled_error
from bps.compressors.momentum import nesterov_step
from bps.worker.partition import partition

# the compressed weights; the 1100 x 10 layer and the biases are under min_compress_bytes
# (64 KB) and travel uncompressed
LAYERS = (784 * 1100, 1100 * 1100)
PARAMS = {
    "onebit": {"compressor": "onebit", "scaling": True, "ef": "vanilla",
               "momentum": "nesterov", "mu": 0.9},
    "topk": {"compressor": "topk", "k": 0.01, "ef": "vanilla", "momentum": "nesterov",
             "mu": 0.9},
    "randomk": {"compressor": "randomk", "k": 0.01, "ef": "vanilla", "momentum": "nesterov",
                "mu": 0.9, "seed": 7},
    "dithering": {"compressor": "dithering", "k": 4, "ef": "vanilla", "seed": 7},
}


class Cluster:
    """The chains of every partition on every worker, and the servers' chains."""

    def __init__(self, params: dict, sizes: list[int], workers: int) -> None:
        self.sizes = sizes
        self.workers = [[build(params, n, role="worker") for n in sizes] for _ in range(workers)]
        self.servers = [build(params, n, role="server") for n in sizes]
        self.grads = [[torch.randn(n) * 1e-3 for n in sizes] for _ in range(workers)]
        self.out = [torch.empty(n) for n in sizes]
        self.sums = [torch.empty(n) for n in sizes]
        self.lookahead = [torch.empty(n) for n in sizes]

    def step(self, new: bool) -> dict[str, float]:
        """One cluster step with the new code paths, or with the old ones."""
        times = dict.fromkeys(("worker compress", "server sum", "server compress",
                               "worker decompress"), 0.0)

        def timed(part: str, fn, *args):
            start = time.perf_counter()
            result = fn(*args)
            times[part] += time.perf_counter() - start
            return result

        for p in range(len(self.sizes)):
            pushes = [timed("worker compress", self._compress, w, p, new)
                      for w in range(len(self.workers))]
            server = self.servers[p]
            total = timed("server sum", self._sum, server, pushes, p, new)
            result = timed("server compress", error_feedback, server, total, new)
            for w in range(len(self.workers)):
                timed("worker decompress", self.workers[w][p].decompress, result, self.out[p])
        return times

    def _compress(self, w: int, p: int, new: bool) -> torch.Tensor:
        chain, grad = self.workers[w][p], self.grads[w][p]
        if not hasattr(chain, "mu"):  # dithering's chain has no momentum
            return error_feedback(chain, grad, new)
        if new:
            return chain.compress(grad)
        array = grad.numpy()
        momentum = chain.momentum.numpy()  # updated in place, as the old chain did
        mu = array.dtype.type(chain.mu)
        nesterov_step(array, momentum, mu, mu, self.lookahead[p].numpy(), momentum)
        return chain.inner.compress(self.lookahead[p])

    def _sum(self, server, pushes: list, p: int, new: bool) -> torch.Tensor:
        if new:
            total = server.decompress(pushes[0], self.sums[p])
            for payload in pushes[1:]:
                server.decompress_add(payload, total, self.out[p])
            return total
        total = server.decompress(pushes[0])  # the old server: a new tensor per step
        for payload in pushes[1:]:
            total.add_(server.decompress(payload, self.out[p]))
        return total


def error_feedback(chain: ErrorFeedback, x: torch.Tensor, new: bool) -> torch.Tensor:
    """``chain.compress(x)``; old: for dithering, the error by decoding the payload."""
    if new or not isinstance(chain.inner, Dithering):
        return chain.compress(x)
    corrected = chain.error
    add_scaled_error(x.numpy(), np.float32(chain.ratio), corrected.numpy(), corrected.numpy())
    payload = chain.inner.compress(corrected)
    corrected.sub_(chain.inner.decompress(payload))
    return payload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--partition-bytes", type=int, default=2048000,
                   help="BYTEPS_PARTITION_BYTES (bench/slow_network.py's for compressed runs)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="kernel threads (compressors.threads)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--only", default=None, help="one compressor")
    args = p.parse_args()
    threads.THREADS = args.threads
    torch.manual_seed(0)
    sizes = [length for n in LAYERS for _, length in partition(n, 4, args.partition_bytes)]
    print(f"partitions {sizes}, {args.workers} workers, {args.threads} kernel thread(s); "
          "ms per step, median of", args.steps)
    print("| compressor | worker compress: new / old | server sum: new / old | "
          "server compress: new / old | worker decompress | total: new / old |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in [args.only] if args.only else PARAMS:
        cluster = Cluster(PARAMS[name], sizes, args.workers)
        new, old = [], []
        for _ in range(2):
            cluster.step(True)
            cluster.step(False)
        for _ in range(args.steps):  # alternating, so a slower period hits both alike
            new.append(cluster.step(True))
            old.append(cluster.step(False))

        def median(rows: list[dict], part: str) -> float:
            return statistics.median(r[part] for r in rows) * 1e3

        parts = ("worker compress", "server sum", "server compress", "worker decompress")
        total_new = sum(median(new, part) for part in parts)
        total_old = sum(median(old, part) for part in parts)
        print(f"| {name} | {median(new, parts[0]):.1f} / {median(old, parts[0]):.1f} | "
              f"{median(new, parts[1]):.1f} / {median(old, parts[1]):.1f} | "
              f"{median(new, parts[2]):.1f} / {median(old, parts[2]):.1f} | "
              f"{median(new, parts[3]):.1f} | "
              f"**{total_new:.1f}** / {total_old:.1f} |")


if __name__ == "__main__":
    main()
