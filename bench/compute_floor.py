"""What the host's cores allow: the slow-network job's local steps with no framework and
no network.

``--nodes`` processes on this host each train the slow-network job's model for
``--epochs`` epochs (examples/mnist_job.py's model, data, batches and SGD, one torch
thread, as examples/mnist.py runs them) and communicate not at all; rank 0 also tests on
the 1,000 held-out digits at every epoch end, as examples/mnist.py does. They start
together, after a barrier. The slowest process's time is a floor under every method's
time to a target reached after that many epochs on this host (bench/slow_network.py,
whose nodes share the same cores): no framework and no link trains the same steps
faster. ``--no-eval`` leaves the tests out::

    .venv/bin/python bench/compute_floor.py                          # the MLP, 8 epochs
    .venv/bin/python bench/compute_floor.py --model cnn --epochs 9
    .venv/bin/python bench/compute_floor.py --rounds 3               # best and median

The result goes to bench/results/compute_floor_<model>.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
NODE_TIMEOUT_S = 600  # a node that takes longer has hung


def train(rank: int, args: argparse.Namespace, barrier, results) -> None:
    """One node: ``args.epochs`` epochs of local steps; puts (rank, seconds, test seconds,
    steps)."""
    import torch
    import torch.nn.functional as F
    from mnist_job import (
        accuracy,
        epoch_batches,
        load_mnist,
        make_model,
        make_optimizer,
        model_inputs,
    )

    torch.set_num_threads(1)
    (x_train, y_train), (x_test, y_test) = (
        (model_inputs(x, args.model), y) for x, y in load_mnist(1000, args.seed))
    torch.manual_seed(args.seed)
    model = make_model(args.model, args.hidden, args.layers)
    optimizer = make_optimizer(model, args.lr, 0.9, torch.device("cpu"))
    generator = torch.Generator().manual_seed(args.seed)
    barrier.wait(timeout=NODE_TIMEOUT_S)
    start, tested, steps = time.perf_counter(), 0.0, 0
    for _ in range(args.epochs):
        for batch in epoch_batches(len(y_train), rank, args.nodes, args.batch_size, generator):
            steps += 1
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
        if rank == 0 and args.eval:
            test_start = time.perf_counter()
            accuracy(model, x_test, y_test)
            tested += time.perf_counter() - test_start
    results.put((rank, time.perf_counter() - start, tested, steps))


def one_round(args: argparse.Namespace) -> dict:
    """All nodes once: the slowest one's seconds, rank 0's seconds of testing, and the
    steps each node took."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(args.nodes), context.Queue()
    procs = [context.Process(target=train, args=(rank, args, barrier, results))
             for rank in range(args.nodes)]
    for proc in procs:
        proc.start()
    got: list[tuple[int, float, float, int]] = []
    deadline = time.monotonic() + NODE_TIMEOUT_S
    try:
        while len(got) < len(procs):
            failed = [rank for rank, proc in enumerate(procs) if proc.exitcode]
            if failed:
                raise SystemExit(f"node {failed[0]} failed (exit code "
                                 f"{procs[failed[0]].exitcode})")
            if time.monotonic() > deadline:
                raise SystemExit(f"nodes {sorted(set(range(len(procs))) - {r for r, *_ in got})}"
                                 f" did not finish within {NODE_TIMEOUT_S} s")
            try:
                got.append(results.get(timeout=1))
            except queue.Empty:
                pass
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return {"seconds": max(seconds for _, seconds, _, _ in got),
            "test_seconds": sum(tested for _, _, tested, _ in got),
            "steps": got[0][3]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1100)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-eval", dest="eval", action="store_false",
                   help="no tests at the epoch ends")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args()
    runs = [one_round(args) for _ in range(args.rounds)]
    seconds = [r["seconds"] for r in runs]
    steps = runs[0]["steps"]  # every node takes the same number (mnist_job.epoch_batches)
    print(f"{args.nodes} nodes on {os.cpu_count()} cores, {args.model}, {args.epochs} epochs "
          f"({steps} steps), no communication: best {min(seconds):.2f} s, median "
          f"{statistics.median(seconds):.2f} s ({1000 * min(seconds) / steps:.1f} ms a step); "
          f"rank 0's tests {statistics.median(r['test_seconds'] for r in runs):.2f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compute_floor_{args.model}.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                "runs": runs}, indent=1))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
