"""Step time of bps's DistributedTrainer relative to torch DDP (gloo), same model, one run.

Usage::

    .venv/bin/python bench/trainer_overhead.py              # 2 nodes x 1 local rank, 1 server
    .venv/bin/python bench/trainer_overhead.py --steps 20 --json out.json

The parent starts a loopback cluster with ``bpslaunch local --workers 2 --servers 1``;
both worker processes then time, one after the other, DDP over a gloo group of their
own, bps uncompressed (fp16 on the wire, the default), bps uncompressed in fp32,
bps with onebit + error feedback, and the same onebit + error feedback through DDP with
the bps hook (:mod:`bps.ddp`: same pipeline, DDP's buckets in front), on a
~25M-parameter MLP (one copy per configuration, all alive at once). Rank 0 prints a table of
median step times and their ratio to DDP. The configurations take turns in
interleaved rounds (a barrier before every step), so background load hits all alike.
The whole cluster runs twice, with CURVE (the default) and with ``BPS_INSECURE=1``,
alternating ``--auth-rounds`` times; the table gives both and what CURVE costs (target:
compressed within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "bps uncompressed (fp16 wire)": {},
    "bps uncompressed (fp32 wire)": {"fp16": False},
    "bps onebit + EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
}
# DDP with bps.ddp.ps_hook, gradient_as_bucket_view (no copy of the buckets back into
# .grad); the second keeps .grad between steps (zero_grad(set_to_none=False)), so autograd
# accumulates into the bucket views instead of DDP copying fresh gradients into them
HOOK_CONFIGS = {
    "DDP + bps hook, onebit + EF": (CONFIGS["bps onebit + EF"], True),
    "DDP + bps hook, onebit + EF, grads kept": (CONFIGS["bps onebit + EF"], False),
}


def build_model(width: int):
    import torch

    # width 4096: 1024*4096 + 4096*4096 + 4096*1024 weights + biases = 25.2M parameters
    return torch.nn.Sequential(
        torch.nn.Linear(1024, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1024),
    )


def child(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import bps

    torch.set_num_threads(1)
    bps.init()
    rank, size = bps.rank(), bps.size()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.ddp_port}",
                            rank=rank, world_size=size)
    torch.manual_seed(rank)
    x = torch.randn(args.batch, 1024)
    y = torch.randn(args.batch, 1024)
    loss_fn = torch.nn.MSELoss()

    def ddp_runner():
        ddp = DistributedDataParallel(build_model(args.width))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad()
            loss_fn(ddp(x), y).backward()
            optimizer.step()
            return None
        return step, lambda: None

    def bps_runner(params):
        model = build_model(args.width)
        trainer = bps.DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                         params)

        def step():
            trainer.zero_grad()
            loss_fn(model(x), y).backward()
            trainer.step()
            return trainer.stats()
        return step, trainer.close

    def hook_runner(params, set_to_none):
        import bps.ddp

        ddp = DistributedDataParallel(build_model(args.width), gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        state = bps.ddp.HookState(params, optimizer)
        ddp.register_comm_hook(state, bps.ddp.ps_hook)

        def step():
            optimizer.zero_grad(set_to_none=set_to_none)
            loss_fn(ddp(x), y).backward()
            optimizer.step()
            return state.stats()
        return step, state.close

    runners = {"torch DDP (gloo)": ddp_runner()}
    runners.update({name: bps_runner(params) for name, params in CONFIGS.items()})
    runners.update({name: hook_runner(*config) for name, config in HOOK_CONFIGS.items()})
    numel = sum(p.numel() for p in build_model(args.width).parameters())
    times = {name: [] for name in runners}
    stats = {}
    # Interleaved rounds, so that load from other processes hits every configuration alike.
    for round_ in range(args.rounds):
        for name, (step, _) in runners.items():
            for i in range(args.warmup + args.steps):
                dist.barrier()
                start = time.perf_counter()
                stats[name] = step()
                if i >= args.warmup or round_ > 0:
                    times[name].append(time.perf_counter() - start)
    for _, close in runners.values():
        close()
    if rank == 0:
        results = {**times, **{f"{n} stats": s for n, s in stats.items() if s}}
        Path(args.out).write_text(json.dumps({"parameters": numel, "batch": args.batch,
                                              "results": results}))
    dist.destroy_process_group()
    bps.shutdown()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cluster(args: argparse.Namespace, secure: bool) -> dict | None:
    """One loopback cluster running every configuration; its rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", "2",
               "--servers", "1", "--", sys.executable, os.path.abspath(__file__), "--child",
               "--out", out,
               "--ddp-port", str(free_port()), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--rounds", str(args.rounds),
               "--batch", str(args.batch),
               "--width", str(args.width)]
        env = {**os.environ, "BPS_TIMEOUT": os.environ.get("BPS_TIMEOUT", "120"),
               "BPS_INSECURE": "0" if secure else "1"}  # bpslaunch local makes a key if 0
        code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL if args.quiet else None,
                              timeout=1800).returncode
        if code:
            print(f"cluster failed with exit code {code}", file=sys.stderr)
            return None
        return json.loads(Path(out).read_text())


def parent(args: argparse.Namespace) -> int:
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.auth_rounds):
        for secure in (True, False):
            data = run_cluster(args, secure)
            if data is None:
                return 1
            runs[secure].append(data)
    data = runs[True][0]
    times = {secure: {} for secure in runs}
    for secure, datas in runs.items():
        for one in datas:
            for name, values in one["results"].items():
                if not name.endswith(" stats"):
                    times[secure].setdefault(name, []).extend(values)
    base = statistics.median(times[True]["torch DDP (gloo)"])
    print(f"\n{data['parameters'] / 1e6:.1f}M parameters, batch {data['batch']} per worker, "
          f"2 worker nodes x 1 local rank, 1 server, loopback; median of "
          f"{args.steps * args.rounds * args.auth_rounds} steps in {args.rounds} interleaved "
          f"rounds per cluster, {args.auth_rounds} clusters with CURVE and as many with "
          f"BPS_INSECURE=1, alternating\n")
    print("| configuration | step time, CURVE (s) | step time, BPS_INSECURE=1 (s) | CURVE "
          "cost | ratio to DDP (CURVE) | bytes pushed / step / node |")
    print("|---|---|---|---|---|---|")
    for name in times[True]:
        secure, plain = (statistics.median(times[s][name]) for s in (True, False))
        pushed = data["results"].get(name + " stats", {}).get("bytes_pushed")
        pushed_text = f"{pushed / 1e6:.1f} MB" if pushed else "(allreduce)"
        cost = "" if name.startswith("torch") else f"{secure / plain - 1:+.1%}"
        print(f"| {name} | {secure:.3f} | {plain:.3f} | {cost} | {secure / base:.2f}x | "
              f"{pushed_text} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"curve": runs[True], "insecure": runs[False]},
                                              indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps in the first round")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--json", default=None, help="also write the raw timings here")
    p.add_argument("--auth-rounds", type=int, default=1,
                   help="clusters with CURVE and as many without, alternating")
    p.add_argument("--quiet", action="store_true", help="hide the cluster's log")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ddp-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
