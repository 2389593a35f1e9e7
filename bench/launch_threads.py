"""torch's threads under ``bpslaunch local``: the launcher's OMP_NUM_THREADS against one
OpenMP worker per core.

Usage::

    .venv/bin/python bench/launch_threads.py                 # 3 rounds of 200 steps
    .venv/bin/python bench/launch_threads.py --rounds 1 --steps 20

Runs the README's quick-start (the MLP 784-512-10, SGD with momentum, onebit + EF +
Nesterov; one synthetic batch of 64, so no data loading) under ``bpslaunch local
--workers 2 --servers 1``, in turns: with ``OMP_NUM_THREADS`` unset, so the launcher
sets it (the cores shared by the job's processes), and with ``OMP_NUM_THREADS`` = the
cores, what torch uses in a process left alone. Prints worker 0's mean step after 30
warm-up steps per round, and the median of the rounds.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from bps.common.striping import host_cores

JOB = """
import sys, time, torch, bps
steps = int(sys.argv[1])
bps.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
trainer = bps.DistributedTrainer(model, optimizer, compression_params={
    "compressor": "onebit", "ef": "vanilla", "momentum": "nesterov"})
x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
for step in range(30 + steps):
    if step == 30:
        start = time.perf_counter()
    trainer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    trainer.step()
if bps.rank() == 0:
    print(f"STEP {torch.get_num_threads()} {(time.perf_counter() - start) / steps * 1e3:.2f}")
trainer.close()
bps.shutdown()
"""


def run(script: str, steps: int, threads: str | None, timeout: float) -> tuple[int, float]:
    """(torch's threads in worker 0, its mean step in ms) of one job."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    done = subprocess.run([sys.executable, "-m", "bps.launch.cli", "local", "--workers", "2",
                           "--servers", "1", "--", sys.executable, script, str(steps)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    found = re.search(r"STEP (\d+) ([\d.]+)", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"the job failed ({done.returncode}):\n{done.stdout[-3000:]}"
                         f"{done.stderr[-3000:]}")
    return int(found.group(1)), float(found.group(2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="timed steps per job")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job")
    args = p.parse_args()
    cores = host_cores()
    configs = {"OMP_NUM_THREADS unset: the launcher's": None,
               f"OMP_NUM_THREADS={cores}: one per core": str(cores)}
    results: dict[str, list[tuple[int, float]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "quickstart.py")
        with open(script, "w") as handle:
            handle.write(JOB)
        for _ in range(args.rounds):
            for name, threads in configs.items():
                results[name].append(run(script, args.steps, threads, args.timeout))
    print(f"{cores} cores; 2 workers + 1 server; {args.steps} steps a round\n")
    print("| worker processes | torch threads | step ms (rounds) | median |")
    print("|---|---:|---|---:|")
    for name, runs in results.items():
        steps = ", ".join(f"{ms:.1f}" for _, ms in runs)
        print(f"| {name} | {runs[0][0]} | {steps} | "
              f"{statistics.median(ms for _, ms in runs):.1f} |")


if __name__ == "__main__":
    main()
