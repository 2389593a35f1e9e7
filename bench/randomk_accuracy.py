"""randomk's accuracy on the slow-network job, over k, momentum, error feedback and lr.

Test accuracy does not depend on the link speed, so this runs the job of
``bench/slow_network.py`` (examples/mnist.py, 4 worker nodes, 4 servers, its partition
sizes, job seed and lr schedule, 16 epochs unless ``--epochs`` says otherwise) on a
loopback cluster (``bpslaunch local``) and prints the test accuracy after every epoch for
each setting, next to uncompressed fp32 and topk 1%. Servers sum in node order, so a
setting of the table gets the same accuracies here, epoch by epoch, as in its table run.

Usage::

    .venv/bin/python bench/randomk_accuracy.py                 # 11 runs, about 16 minutes
    .venv/bin/python bench/randomk_accuracy.py --only fp32,topk-1,rk-1,rk-3
    .venv/bin/python bench/randomk_accuracy.py --only rk-1 --job-seed 2   # other draws
    .venv/bin/python bench/randomk_accuracy.py --lr-schedule constant     # before cd0376b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slow_network import EF_NESTEROV, REPO, Method, job_args  # bench/ is the script's path
from slow_network import parse_args as slow_network_defaults

RUNNER = slow_network_defaults([])
JOB = job_args(RUNNER)  # the slow-network table's job, by construction


def randomk(k: float, *extra: str) -> list[str]:
    return ["--compressor", "randomk", "--k", str(k), *extra]


SETTINGS = {  # name -> examples/mnist.py arguments after JOB (later flags win)
    "fp32": ["--compressor", "none", "--no-fp16"],
    "topk-1": ["--compressor", "topk", "--k", "0.01", *EF_NESTEROV],
    "rk-1": randomk(0.01, *EF_NESTEROV),
    "rk-3": randomk(0.03, *EF_NESTEROV),
    "rk-5": randomk(0.05, *EF_NESTEROV),
    "rk-10": randomk(0.1, *EF_NESTEROV),
    "rk-10-mu0.5": randomk(0.1, *EF_NESTEROV, "--mu", "0.5"),
    "rk-10-no-momentum": randomk(0.1, "--ef", "vanilla", "--momentum", "none"),
    "rk-10-lr0.02": randomk(0.1, *EF_NESTEROV, "--lr", "0.02"),
    "rk-10-no-ef": randomk(0.1, "--ef", "none", "--momentum", "nesterov"),
    "rk-50": randomk(0.5, *EF_NESTEROV),
}


def run(name: str, workdir: Path, timeout: float, job_seed: int,
        extra: list[str]) -> list[float]:
    """Test accuracy after each epoch of one setting ([] if the run failed)."""
    metrics = workdir / f"{name}.json"
    job = JOB + extra  # later flags win
    argv = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", "4", "--servers",
            "4", "--", sys.executable, str(REPO / "examples" / "mnist.py"), *job,
            *SETTINGS[name], "--metrics-json", str(metrics)]
    # the runner's partitions (randomk draws per partition) and a fixed job seed: with the
    # servers' node-order sums a setting of the table gets the same accuracies here
    method = Method(name, name, "bps", tuple(SETTINGS[name]), 0.0)
    env = dict(os.environ, BYTEPS_PARTITION_BYTES=str(method.partition_bytes(RUNNER)),
               BPS_JOB_SEED=str(job_seed))
    log = workdir / f"{name}.log"
    with open(log, "w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                              timeout=timeout).returncode
    if code != 0 or not metrics.exists():
        tail = "\n".join(log.read_text().splitlines()[-15:])
        print(f"{name}: FAILED, exit code {code}; last lines of its log:\n{tail}", flush=True)
        return []
    return [e["test_accuracy"] for e in json.loads(metrics.read_text())["epochs"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated settings: " + ",".join(SETTINGS))
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"default {JOB[JOB.index('--epochs') + 1]}, the slow-network job's")
    parser.add_argument("--lr-schedule", choices=["constant", "cosine"], default=None,
                        help=f"default {RUNNER.lr_schedule}, the slow-network job's")
    parser.add_argument("--job-seed", type=int, default=RUNNER.seed + 1,
                        help="BPS_JOB_SEED (randomk's draws); default the runner's")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds per run")
    args = parser.parse_args()
    extra = (["--epochs", str(args.epochs)] if args.epochs else []) + (
        ["--lr-schedule", args.lr_schedule] if args.lr_schedule else [])
    names = args.only.split(",") if args.only else list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {','.join(SETTINGS)}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bps-randomk-") as tmp:
        for index, name in enumerate(names):
            start = time.monotonic()
            accuracies = run(name, Path(tmp), args.run_timeout, args.job_seed, extra)
            rows.append((name, accuracies))
            final = f"final {accuracies[-1]:.1%}" if accuracies else "failed"
            print(f"[{index + 1}/{len(names)}] {name}: {final} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    print(f"\n4 nodes x 1 process, 4 servers, loopback; {started}\n")
    epochs = max(len(a) for _, a in rows)
    print("| setting | " + " | ".join(f"ep {e + 1}" for e in range(epochs)) + " | best |")
    print("|---|" + "---:|" * (epochs + 1))
    for name, accuracies in rows:
        cells = [f"{a:.1%}" for a in accuracies] or ["failed"] * epochs
        best = f"{max(accuracies):.1%}" if accuracies else "-"
        print(f"| {name} | {' | '.join(cells)} | {best} |")
    if any(not accuracies for _, accuracies in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
