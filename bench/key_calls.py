"""What one key's calls cost outside the kernels: a onebit + EF key's chain, its server
and its headers, timed alone in one process.

Usage::

    .venv/bin/python bench/key_calls.py                 # about 20 s
    .venv/bin/python bench/key_calls.py --numel 64 65536 1048576

For each ``--numel``: a worker chain's compress (error feedback's pass and onebit's, the
learning rate set first, as a push does) and its decode of an aggregate into a kept
tensor (as the engine decodes into ``.grad``); a server's aggregator taking one worker
node's push and finishing the step (the payload checked, summed with its error
feedback, re-encoded); and the protocol's decode of the headers each push brings (PUSH
on the server, ACK and DATA on the worker). Each figure is the best of ``--repeat``
runs of ``--number`` calls, in microseconds a call: at 64 elements the kernels cost
almost nothing, so what is left is the Python around them, which a busy host makes
worse but never better (bench/key_overhead.py and bench/agent_stages.py time the same
calls in place).

    >>> rows = measure([64], number=20, repeat=1)
    >>> sorted(rows[0]) == sorted(COLUMNS)
    True
"""

from __future__ import annotations

import argparse
import timeit

import torch

from bps.common.protocol import Op, decode, encode
from bps.compressors import build
from bps.server.aggregator import Aggregator

PARAMS = {"compressor": "onebit", "ef": "vanilla", "scaling": True}
COLUMNS = ["numel", "worker compress", "worker decode", "server push + finish",
           "headers decoded"]


def measure(sizes: list[int], number: int, repeat: int) -> list[dict]:
    """One row per size: ``COLUMNS``, in microseconds a call."""

    def best(call) -> float:
        return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6

    push = encode(Op.PUSH, rid=1, key=1, step=1, node=0, dtype="float32", numel=65536,
                  nbytes=8196, lr=0.1, peer="worker 0")
    ack = encode(Op.ACK, rid=1)
    data = encode(Op.DATA, rid=1, key=1, step=1, nbytes=8196, server_s=0.0001)
    headers = best(lambda: (decode(push), decode(ack), decode(data)))
    rows = []
    for numel in sizes:
        worker = build(PARAMS, numel, torch.float32)
        gradient = torch.randn(numel, generator=torch.Generator().manual_seed(numel))

        def compress(worker=worker, gradient=gradient) -> torch.Tensor:
            worker.set_lr(0.1)
            return worker.compress(gradient)

        payload = compress()
        frame = memoryview(payload.numpy().tobytes())  # as a reply's frame reaches the engine
        out = torch.empty(numel)
        aggregator = Aggregator(1)
        aggregator.register(1, numel, torch.float32, PARAMS, "weight", 0)
        steps = iter(range(1 << 62))

        def serve(aggregator=aggregator, payload=payload, steps=steps) -> None:
            # the push's buffer as the server's frames give it: a tensor over the bytes
            pushed = aggregator.push(1, 0, next(steps), [payload.numpy()], 0.1, None)
            assert pushed.finished

        rows.append({"numel": numel, "worker compress": best(compress),
                     "worker decode": best(lambda w=worker, f=frame, o=out: w.decompress(f, o)),
                     "server push + finish": best(serve), "headers decoded": headers})
    return rows


def table(rows: list[dict]) -> str:
    """The rows as markdown."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join([str(row["numel"])] + [f"{row[c]:.1f}" for c in
                                                              COLUMNS[1:]]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, nargs="+", default=[64, 65536])
    p.add_argument("--number", type=int, default=2000, help="calls a run (default 2000)")
    p.add_argument("--repeat", type=int, default=7, help="runs; the best counts (default 7)")
    args = p.parse_args()
    print("us a call, best of", args.repeat, "runs of", args.number)
    print(table(measure(args.numel, args.number, args.repeat)))


if __name__ == "__main__":
    main()
